"""`sarathictl bench simulate`: one simulated run of a deployment at a given arrival rate."""

from __future__ import annotations

import argparse
import json
import time

from controller.scheduler import policy_names
from sarathictl.argtypes import float_above
from sarathictl.bench.progress import Periodic, rate, say
from sarathictl.bench.sim_args import add_setup_args, setup_from_args
from sarathictl.bench.sim_run import prepare

PROGRESS_INTERVAL_S = 2.0
"""Wall seconds between two progress lines of a long simulation."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "simulate",
        help="run a workload through the scheduler and a simulated pipeline",
        description="Virtual-time run of the real scheduler against a cost model of the layout.",
    )
    add_setup_args(parser)
    parser.add_argument(
        "--policy", default="sarathi", choices=policy_names(), help="batching policy"
    )
    parser.add_argument(
        "--qps", type=float_above(0.0), default=1.0, help="mean arrival rate, requests/s"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    setup = setup_from_args(args, args.policy)
    sim = prepare(setup)
    total = len(sim.unit_requests)
    say(
        f"simulating {total} requests at {rate(args.qps)}: {setup.model} on "
        f"{setup.tp}x{setup.pp} {setup.gpu}, {setup.policy}"
    )
    started = time.perf_counter()

    def progress(done: int) -> None:
        elapsed = time.perf_counter() - started
        say(f"simulating: {done}/{total} requests finished ({done / total:.0%}, {elapsed:.1f} s)")

    metrics = sim.run(args.qps, progress=Periodic(progress, PROGRESS_INTERVAL_S))
    wall_s = time.perf_counter() - started
    say(f"simulated {metrics.num_requests} requests in {wall_s:.1f} s")
    report = {
        "setup": {
            "model": setup.model,
            "gpu": setup.gpu,
            "tp": setup.tp,
            "pp": setup.pp,
            "link": setup.link,
            "policy": setup.policy,
            "budget_tokens": sim.scheduler_config.budget_tokens,
            "trace": setup.workload.source,
            "qps": args.qps,
            "num_kv_blocks": sim.cache_config.num_blocks,
        },
        "metrics": metrics.to_dict(),
        "wall_s": wall_s,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    m = metrics
    print(
        f"{setup.model} on {setup.tp}x{setup.pp} {setup.gpu} ({setup.link}), {setup.policy} "
        f"budget {sim.scheduler_config.budget_tokens}, {setup.workload.source} at {args.qps} qps"
    )
    print(f"  requests          {m.num_requests} in {m.duration_s:.1f} s simulated")
    print(f"  TTFT P50/P90/P99  {m.ttft_p50_s:.3f} / {m.ttft_p90_s:.3f} / {m.ttft_p99_s:.3f} s")
    print(f"  TBT P50/P99       {m.tbt_p50_s:.4f} / {m.tbt_p99_s:.4f} s")
    print(
        f"  sched delay P50   {m.scheduling_delay_p50_s:.3f} s (P99 {m.scheduling_delay_p99_s:.3f})"
    )
    print(f"  throughput        {m.throughput_rps:.3f} req/s, {m.throughput_tokens_s:.0f} tokens/s")
    print(f"  {m.stage_line(digits=1)}")
    print(f"  preemptions       {m.num_preemptions}; wall time {wall_s:.1f} s")
    print(f"  prefix cache      {m.prefix_cached_token_share:.1%} of admitted tokens cached")
    return 0
