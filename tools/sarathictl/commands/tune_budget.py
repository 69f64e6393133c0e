"""`sarathictl tune-budget`: the paper's one-time profiling (section 4.3) on a live pipeline.

For growing token counts T (multiples of the tile), one request of a T-token prompt runs alone
through the pipeline; its time to first token is the time one micro-batch of T tokens takes to
cross every stage, which is also the gap a decode sees when its micro-batch carries T tokens.
The largest T whose time stays within the TBT SLO is the budget. The measured profile is
written as the CSV the simulated executor loads (`bench simulate --profile`).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys

import grpc
import numpy as np
from sarathi_proto import generate_pb2

from sarathictl.argtypes import float_above, int_at_least
from sarathictl.bench.live_load import PROMPT_ID_LIMIT
from sarathictl.client import DEFAULT_ADDR, Client, explain_rpc_error


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tune-budget", help="profile step time against tokens; pick the budget")
    p.add_argument("--addr", default=DEFAULT_ADDR, help=f"controller (default {DEFAULT_ADDR})")
    p.add_argument(
        "--tbt-slo", type=float_above(0.0), required=True, help="P99 TBT target, seconds"
    )
    p.add_argument("--tile", type=int_at_least(1), default=32, help="budgets are multiples of this")
    p.add_argument(
        "--max-tokens",
        type=int_at_least(0),
        default=0,
        help="largest micro-batch to try (0, the default: the cluster's own budget, its upper "
        "bound)",
    )
    p.add_argument(
        "--repeats", type=int_at_least(1), default=3, help="runs per size (median taken)"
    )
    p.add_argument("--profile-out", default="", help="write the measured profile CSV here")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def measure(client: Client, num_tokens: int, repeats: int, rng: np.random.Generator) -> float:
    """Median server-side time to first token of a lone num_tokens-token prompt, seconds."""
    times = []
    for _ in range(repeats):
        prompt = rng.integers(1, PROMPT_ID_LIMIT, num_tokens).tolist()
        request = generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=1, ignore_eos=True
        )
        last = None
        for response in client.generate(request, timeout_s=600):
            last = response
        assert last is not None
        times.append(last.ttft_s)
    return statistics.median(times)


def say(line: str) -> None:
    """A progress line on stderr, also with --json (stdout then holds only the JSON)."""
    print(f"[tune-budget] {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(0)
    rows: list[dict[str, float]] = []
    with Client(args.addr) as client:
        try:
            status = client.status()
            cluster_budget = status.scheduler.budget_tokens
            pp = max(1, status.scheduler.pipeline_depth)
            limit = min(args.max_tokens or cluster_budget, cluster_budget)
            if limit < args.tile:
                raise ValueError(f"the cluster's budget ({cluster_budget}) is below one tile")
            sizes = range(args.tile, limit + 1, args.tile)
            say(
                f"{args.addr}: budget {cluster_budget} tokens, PP={pp}; timing micro-batches of "
                f"{args.tile}..{sizes[-1]} tokens ({len(sizes)} sizes, {args.repeats} runs each) "
                f"against a {args.tbt_slo * 1e3:g} ms SLO"
            )
            say(f"warm-up ({args.tile} tokens)")
            measure(client, args.tile, 1, rng)  # warm-up: first steps pay one-time costs
            for i, num_tokens in enumerate(sizes, start=1):
                latency = measure(client, num_tokens, args.repeats, rng)
                rows.append({"num_tokens": num_tokens, "pipeline_s": latency})
                verdict = "within" if latency <= args.tbt_slo else "over"
                say(
                    f"[{i}/{len(sizes)}] {num_tokens} tokens: {latency * 1e3:.1f} ms "
                    f"({verdict} the SLO)"
                )
                if latency > args.tbt_slo * 1.5:
                    say("well past the SLO: larger micro-batches only get slower; stopping")
                    break
        except grpc.RpcError as err:
            print(f"sarathictl: {explain_rpc_error(err, args.addr)}", file=sys.stderr)
            return 1
    fitting = [r for r in rows if r["pipeline_s"] <= args.tbt_slo]
    budget = int(max(r["num_tokens"] for r in fitting)) if fitting else 0
    if args.profile_out:
        with open(args.profile_out, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["num_tokens", "context_tokens", "stage_time_s"])
            for r in rows:  # a prompt from scratch attends to itself: context = tokens
                n = int(r["num_tokens"])
                writer.writerow([n, n, f"{r['pipeline_s'] / pp:.6f}"])
    result = {"tbt_slo_s": args.tbt_slo, "budget_tokens": budget, "pp": pp, "rows": rows}
    if args.json:
        print(json.dumps(result))
    elif budget:
        capped = " (the cluster's own budget caps the search)" if budget == limit else ""
        print(f"budget: {budget} tokens keeps a micro-batch within {args.tbt_slo} s{capped}")
    else:
        print(f"no micro-batch of {args.tile} tokens or more fits within {args.tbt_slo} s")
    return 0 if budget else 1
