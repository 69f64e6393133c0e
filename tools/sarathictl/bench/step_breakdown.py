"""`sarathictl bench step-breakdown`: where a live step's time goes, controller and workers.

Starts a local cluster as `sarathictl up --local` does (same defaults: the demo model, PP=2,
the machine's cores shared out, bf16 where the CPU computes it natively) and runs scenarios one
after the other: N requests decoding together (the batch), and a mixed batch (decodes while
long prompts keep arriving, so prompt chunks share the micro-batches). Each scenario reads the
controller's Status once every request is past a warm-up and again a window of tokens later,
and reports the difference of the phase totals per micro-batch:
- controller: schedule, encode, send, receive, decode, apply, detokenize, stream, and the rest
  of its wall time (APIs, event loop, waiting); the names of `bench controller-step`;
- each stage: prepare the plan, wait for the previous stage's activations, linear layers,
  attention, the rest of the forward pass, logits, sampling, send.
With PP > 1 the decodes are spread over the micro-batches in flight, so a micro-batch of
`batch N` holds about N / PP of them and a request's TPOT spans PP micro-batches. vLLM's
median TPOT comes from `make bench-vs-vllm`'s summary.json when there is one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

import grpc
import numpy as np
from sarathi_proto import generate_pb2_grpc

from sarathictl.argtypes import comma_list, float_above, int_at_least
from sarathictl.bench.breakdown import ScenarioBreakdown, scenario_breakdown, totals_of
from sarathictl.bench.breakdown_load import Scenario, run_scenario, until_idle, warm_up
from sarathictl.bench.breakdown_report import (
    VllmTpot,
    as_json,
    markdown,
    ms,
    read_vllm_summary,
)
from sarathictl.bench.progress import say
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig

DEFAULT_MAX_NUM_SEQS = 128
"""The controller's own default (below the budget): raised only for larger scenarios."""


def scenarios_of(args: argparse.Namespace) -> list[Scenario]:
    common = {
        "prompt_tokens": args.prompt_tokens,
        "warmup_tokens": args.warmup_tokens,
        "window_tokens": args.window_tokens,
    }
    out = [Scenario(f"batch {n}", n, **common) for n in args.batches]
    if args.mixed_decodes:
        out.append(
            Scenario(
                f"mixed {args.mixed_decodes} + {args.mixed_prompt_tokens}-token prompts",
                args.mixed_decodes,
                prefill_tokens=args.mixed_prompt_tokens,
                prefill_streams=args.mixed_streams,
                **common,
            )
        )
    if not out:
        raise ValueError("--batches and --mixed-decodes: no scenario left to run")
    return out


def cluster_for(args: argparse.Namespace, scenarios: list[Scenario]) -> LocalClusterConfig:
    """`up --local`'s configuration, with room for the largest scenario's requests."""
    from sarathictl.commands.up import cluster_config, decode_ahead_for

    config = cluster_config(args, port=0)
    needed = max(s.decodes + s.prefill_streams for s in scenarios)
    if needed > config.budget_tokens:
        raise ValueError(
            f"--batches/--mixed-decodes: {needed} requests at once need --budget >= {needed} "
            "(every decode must fit a micro-batch)"
        )
    if needed > DEFAULT_MAX_NUM_SEQS:
        config = dataclasses.replace(config, max_num_seqs=needed)
    ahead = "--decode-ahead" if decode_ahead_for(args.decode_ahead)[0] else "--no-decode-ahead"
    config = dataclasses.replace(
        config, extra_controller_args=(*config.extra_controller_args, ahead)
    )
    return config


async def measure(
    addr: str, scenarios: list[Scenario], seed: int, budget_tokens: int
) -> list[ScenarioBreakdown]:
    rng = np.random.default_rng(seed)
    results = []
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        say("[step-breakdown] warm-up: a few tokens at the largest batch")
        await warm_up(stub, scenarios, rng)
        await until_idle(stub)
        for scenario in scenarios:
            started = time.perf_counter()
            readings = await run_scenario(stub, scenario, rng, budget_tokens)
            await until_idle(stub)
            result = scenario_breakdown(
                scenario.label,
                scenario.decodes,
                totals_of(readings.before),
                totals_of(readings.after),
                readings.client_tpot_s * 1e3,
            )
            say(
                f"[{scenario.label}] {result.controller.steps} micro-batches of "
                f"{result.stages[0].tokens_per_step:.1f} tokens, client TPOT "
                f"{ms(result.client_tpot_ms)} ms; took {time.perf_counter() - started:.1f} s"
            )
            results.append(result)
    return results


def vllm_reference(args: argparse.Namespace) -> list[VllmTpot]:
    if args.vllm_tpot_ms is not None:
        return [VllmTpot("--vllm-tpot-ms", "as given", args.vllm_tpot_ms)]
    return read_vllm_summary(Path(args.vllm_summary))


def run(args: argparse.Namespace) -> int:
    try:
        scenarios = scenarios_of(args)
        vllm = vllm_reference(args)
        config = cluster_for(args, scenarios)
    except ValueError as err:
        say(f"sarathictl bench step-breakdown: {err}")
        return 2
    say(
        f"[step-breakdown] starting a local cluster: {config.model_dir} PP={config.pp} "
        f"TP={config.tp} {config.dtype}, {config.threads_per_worker} thread(s) per worker"
    )
    started = time.perf_counter()
    with LocalCluster(config) as cluster:
        say(f"[step-breakdown] serving after {time.perf_counter() - started:.1f} s")
        results = asyncio.run(measure(cluster.addr, scenarios, args.seed, config.budget_tokens))
    setup = {
        "model": config.model_dir,
        "pp": config.pp,
        "tp": config.tp,
        "dtype": config.dtype,
        "threads_per_worker": config.threads_per_worker,
        "policy": config.policy,
        "budget_tokens": config.budget_tokens,
        "window_tokens": args.window_tokens,
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps({"setup": setup, **as_json(results, vllm)}, indent=1))
        return 0
    title = (
        f"step breakdown: {Path(config.model_dir).name}, PP={config.pp} TP={config.tp} "
        f"{config.dtype}, {config.threads_per_worker} thread(s) per worker, {config.policy} "
        f"budget {config.budget_tokens}; means over {args.window_tokens} tokens per request"
    )
    print(markdown(title, results, vllm))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from sarathictl.commands.up import add_cluster_flags

    p = sub.add_parser(
        "step-breakdown",
        help="where a live step's time goes (controller and worker phases) per scenario",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cluster_flags(p)
    positive = int_at_least(1)
    p.add_argument(
        "--batches",
        type=comma_list(positive, allow_empty=True),
        default=(1, 8, 32),
        help="comma-separated numbers of requests decoding together (default: 1,8,32)",
    )
    p.add_argument(
        "--mixed-decodes",
        type=int_at_least(0),
        default=8,
        help="requests decoding in the mixed scenario (0: no mixed scenario)",
    )
    p.add_argument(
        "--mixed-prompt-tokens",
        type=positive,
        default=384,
        help="length of the prompts kept arriving in the mixed scenario",
    )
    p.add_argument(
        "--mixed-streams", type=positive, default=2, help="mixed: prompts in flight at a time"
    )
    p.add_argument(
        "--prompt-tokens", type=positive, default=16, help="prompt length of the decoding requests"
    )
    p.add_argument(
        "--warmup-tokens", type=positive, default=4, help="tokens per request before measuring"
    )
    p.add_argument("--window-tokens", type=positive, default=32, help="tokens per request measured")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="prompt token ids' seed")
    p.add_argument(
        "--decode-ahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="PP=1: schedule each decode while its token is still being computed, or only once "
        "it is back (default: as `up` picks, on; the two side by side show what going ahead "
        "saves)",
    )
    p.add_argument(
        "--vllm-tpot-ms",
        type=float_above(0.0),
        default=None,
        help="vLLM's median TPOT to show beside ours (default: from --vllm-summary)",
    )
    p.add_argument(
        "--vllm-summary",
        default="bench-results/vs-vllm/summary.json",
        help="`make bench-vs-vllm`'s summary (default: %(default)s); vLLM 'not measured' "
        "without it",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)
