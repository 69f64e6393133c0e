"""`sarathictl bench prefix-routing`: the prefix-cache hit rate of several pipelines behind one
endpoint, under each way of routing requests to them.

It starts --pipelines local clusters (each a controller and its workers, OpenAI API on), then,
policy after policy, holds chat sessions against them (bench/chat_sessions.py: one system prompt,
conversations resending their history) and routes every request as the policy says
(bench/routing_policies.py; `epp` is a model of the endpoint picker the chart deploys,
bench/endpoint_picker.py, fed with the controllers' own /metrics right before each pick). Each
policy gets text of its own, so what an earlier policy left in the caches never hits.

Per policy it prints the controllers' own prefix-cache counts over its run (tokens and requests
that hit), how often a conversation's next turn went back to the pipeline of its previous one,
and the time to first token the users saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

from sarathictl.argtypes import float_at_least, int_at_least
from sarathictl.bench.chat_sessions import ChatWorkload, chat_sessions
from sarathictl.bench.endpoint_picker import EndpointLoad
from sarathictl.bench.progress import say
from sarathictl.bench.routing_policies import PolicyArg, Router, RoutingPolicy, parse_policy
from sarathictl.bench.routing_results import PREFIX_COUNTERS, PolicyResult, Turn, summarize
from sarathictl.local_cluster import LocalCluster

_LOAD_GAUGES = ("sarathi:num_requests_waiting", "sarathi:kv_cache_usage_perc")
REQUEST_TIMEOUT_S = 300.0
"""A turn not answered by then is an error: a pipeline that went down holds its requests."""
READY_TIMEOUT_S = 120.0


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return bytes(response.read())


def scrape(base_url: str, names: Sequence[str]) -> dict[str, float]:
    """The named samples of an endpoint's /metrics (summed over their label sets)."""
    text = get(f"{base_url}/metrics").decode()
    values = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


def endpoint_load(base_url: str) -> EndpointLoad:
    waiting, usage = scrape(base_url, _LOAD_GAUGES).values()
    return EndpointLoad(int(waiting), usage)


class SessionRunner:
    """Holds the sessions of one policy's run, each on a thread of its own."""

    def __init__(self, router: Router, workload: ChatWorkload, model: str, seed: int) -> None:
        self.router = router
        self.workload = workload
        self.model = model
        self.turns: list[Turn] = []
        self.errors: list[str] = []
        self._route_lock = threading.Lock()  # picks one at a time, as the EPP's index needs
        self._sessions = chat_sessions(workload, seed)
        rng = random.Random(seed)
        self._pauses = [  # drawn up front: the threads' order must not change the draws
            [rng.expovariate(1 / workload.think_s) if workload.think_s else 0.0
             for _ in range(workload.turns)]
            for _ in self._sessions
        ]  # fmt: skip

    def run(self) -> None:
        with ThreadPoolExecutor(max_workers=len(self._sessions)) as pool:
            list(pool.map(self._hold, range(len(self._sessions))))

    def _hold(self, index: int) -> None:
        session = self._sessions[index]
        for turn in range(self.workload.turns):
            time.sleep(self._pauses[index][turn])
            messages = session.next_messages()
            prompt = json.dumps(messages, separators=(",", ":"))
            with self._route_lock:
                loads = (
                    {e: endpoint_load(e) for e in self.router.endpoints}
                    if self.router.policy.needs_loads
                    else {}
                )
                endpoint = self.router.route(prompt, loads)
            try:
                answer, ttft_s = self._ask(endpoint, messages)
            except (OSError, ValueError) as err:  # URLError and timeouts are OSErrors
                self.errors.append(f"session {index} turn {turn} at {endpoint}: {err}")
                return
            self.turns.append(Turn(index, turn, endpoint, ttft_s, len(prompt)))
            session.answered(answer)

    def _ask(self, endpoint: str, messages: list[dict[str, str]]) -> tuple[str, float]:
        """The streamed answer's text and its time to first token."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.workload.answer_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        start = time.perf_counter()
        ttft_s = float("nan")
        pieces = []
        url = f"{endpoint}/v1/chat/completions"
        request = urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            for raw in response:  # server-sent events, a line at a time as they come
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    piece = choice.get("delta", {}).get("content") or ""
                    if piece and ttft_s != ttft_s:  # nan: the first token
                        ttft_s = time.perf_counter() - start
                    pieces.append(piece)
        return "".join(pieces), ttft_s


def run_policy(
    policy: RoutingPolicy, endpoints: list[str], model: str, workload: ChatWorkload, seed: int,
) -> PolicyResult:  # fmt: skip
    runner = SessionRunner(Router(policy, endpoints, model, seed), workload, model, seed)
    before = [scrape(e, PREFIX_COUNTERS) for e in endpoints]
    start = time.monotonic()
    runner.run()
    wall_s = time.monotonic() - start
    after = [scrape(e, PREFIX_COUNTERS) for e in endpoints]
    for error in runner.errors:
        say(f"  {policy.name}: {error}")
    return summarize(
        policy.name, runner.turns, len(runner.errors), endpoints, before, after, wall_s
    )


def is_serving(endpoint: str) -> bool:
    try:
        get(f"{endpoint}/health")  # 503 (an HTTPError) while its pipeline is down
    except OSError:
        return False
    return True


def wait_serving(endpoints: list[str], log_dirs: list[Path]) -> None:
    """Every pipeline answers /health with 200, or RuntimeError naming the one that does not
    and its logs: a policy measured with a pipeline down measures timeouts."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    for endpoint, log_dir in zip(endpoints, log_dirs, strict=True):
        while not is_serving(endpoint):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{endpoint} is not serving; see its logs in {log_dir}")
            time.sleep(1.0)


def served_model(endpoint: str) -> str:
    models = json.loads(get(f"{endpoint}/v1/models"))
    return str(models["data"][0]["id"])


def start_pipelines(stack: ExitStack, args: argparse.Namespace) -> list[LocalCluster]:
    """args.pipelines local clusters, stopped when the stack closes."""
    from sarathictl.commands.up import cluster_config

    clusters = []
    for p in range(args.pipelines):
        log_dir = str(Path(args.log_dir) / f"pipeline{p}") if args.log_dir else ""
        config = cluster_config(argparse.Namespace(**{**vars(args), "log_dir": log_dir}), 0, 0)
        config = dataclasses.replace(config, cpu_share=(p, args.pipelines))  # cores of its own
        cluster = stack.enter_context(LocalCluster(config))
        say(f"pipeline {p}: PP={args.pp} TP={args.tp}, {args.threads} thread(s) a worker, at "
            f"http://127.0.0.1:{cluster.http_port} (logs {cluster.log_dir})")  # fmt: skip
        clusters.append(cluster)
    return clusters


def run(args: argparse.Namespace) -> int:
    workload = ChatWorkload(
        sessions=args.sessions, turns=args.turns, system_words=args.system_words,
        question_words=args.question_words, answer_tokens=args.answer_tokens,
        think_s=args.think_s,
    )  # fmt: skip
    if not args.threads:  # the cores shared out among every worker of every pipeline
        cores = len(os.sched_getaffinity(0))
        args.threads = max(1, cores // (args.pipelines * args.pp * args.tp))
    results = []
    with ExitStack() as stack:
        clusters = start_pipelines(stack, args)
        endpoints = [f"http://127.0.0.1:{c.http_port}" for c in clusters]
        model = served_model(endpoints[0])
        for i, policy in enumerate(args.policies):
            try:
                wait_serving(endpoints, [c.log_dir for c in clusters])
            except RuntimeError as err:
                say(f"error before {policy.name}: {err}")
                return 1
            say(f"{policy.name}: {workload.sessions} sessions x {workload.turns} turns ...")
            result = run_policy(policy, endpoints, model, workload, args.seed + i)
            say(result.line())
            results.append(result)
    if args.json_output:
        Path(args.json_output).write_text(json.dumps(
            {"workload": asdict(workload), "pipelines": args.pipelines, "pp": args.pp,
             "threads": args.threads, "results": [asdict(r) for r in results]}, indent=2,
        ) + "\n")  # fmt: skip
    return 1 if any(r.errors for r in results) else 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from sarathictl.commands.up import add_cluster_flags

    p = sub.add_parser(
        "prefix-routing",
        help="prefix-cache hit rate of several local pipelines under each routing policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cluster_flags(p)
    p.set_defaults(pp=1)  # two pipelines of one stage each fill two cores
    positive = int_at_least(1)
    p.add_argument("--pipelines", type=int_at_least(2), default=2, help="pipelines (2)")
    p.add_argument(
        "--policies",
        type=PolicyArg(),
        nargs="+",
        default=[parse_policy(n) for n in ("single", "round-robin", "load", "epp")],
        help="single, round-robin, load (the picker's queue and KV-cache scorers), epp (the "
        "chart's picker: queue 2, KV cache 2, prefix 1) or epp:Q,K,P (default: all but "
        "epp:Q,K,P)",
    )
    d = ChatWorkload()
    p.add_argument("--sessions", type=positive, default=d.sessions, help="conversations at once")
    p.add_argument("--turns", type=positive, default=d.turns, help="user messages a conversation")
    p.add_argument("--system-words", type=positive, default=d.system_words, help="system prompt")
    p.add_argument("--question-words", type=positive, default=d.question_words, help="a message")
    p.add_argument("--answer-tokens", type=positive, default=d.answer_tokens, help="an answer")
    p.add_argument(
        "--think-s", type=float_at_least(0.0), default=d.think_s, help="mean pause between turns"
    )
    p.add_argument("--seed", type=int_at_least(0), default=0, help="text seed of the first policy")
    p.add_argument("--json-output", default="", help="write the results here as JSON")
    p.set_defaults(run=run)
