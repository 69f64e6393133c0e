"""`sarathictl bench run`: replay a workload against a running cluster and report its metrics.

A trace that records arrival times (splitwise, or a user's CSV/JSONL) is replayed at its own
times unless --qps asks for another mean rate (its timeline then stretches or shrinks)."""

from __future__ import annotations

import argparse
import asyncio
import json

from controller.executor.simulated import SimRequest
from sarathictl.argtypes import float_above, int_at_least
from sarathictl.bench.live_load import replay, scale_requests
from sarathictl.bench.sim_args import add_arrival_args, workload_from_args
from sarathictl.bench.workloads import WorkloadSpec, make_requests, recorded_qps, workload_flag
from sarathictl.client import DEFAULT_ADDR


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        type=workload_flag(),
        default="splitwise",
        help="arxiv, splitwise (shipped traces), a CSV or JSONL file, or "
        "lognormal/zipf/uniform/fixed",
    )
    p.add_argument("--num-requests", type=int_at_least(1), default=64, help="requests to send")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="workload and prompt seed")
    p.add_argument(
        "--scale",
        type=float_above(0.0),
        default=1.0,
        help="multiply prompt and output lengths by this (fits a trace to a small model)",
    )
    p.add_argument(
        "--max-total-tokens", type=int_at_least(0), default=0, help="cap prompt+output (0: no cap)"
    )
    add_arrival_args(p.add_argument_group("arrivals"), WorkloadSpec())


def workload(args: argparse.Namespace, qps: float | None) -> tuple[list[SimRequest], float]:
    """The requests, and their mean rate: qps, or a replayed trace's own rate when qps is None.
    --max-total-tokens caps the scaled lengths here, not the trace's rows."""
    spec = workload_from_args(args)
    if qps is None:
        if spec.arrival != "replay":
            raise ValueError(
                f"--qps is needed: {args.trace} is replayed with {spec.arrival} arrivals, "
                "not at recorded times"
            )
        qps = recorded_qps(spec)
    requests = scale_requests(make_requests(spec, qps), args.scale, args.max_total_tokens)
    return requests, qps


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="replay a workload against a running cluster (gRPC)")
    p.add_argument("--addr", default=DEFAULT_ADDR, help=f"controller (default {DEFAULT_ADDR})")
    p.add_argument(
        "--qps",
        type=float_above(0.0),
        default=None,
        help="mean arrival rate, requests/s (default, for a trace with arrival times: its "
        "recorded rate; otherwise required)",
    )
    add_workload_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    requests, qps = workload(args, args.qps)
    result = asyncio.run(replay(args.addr, requests, seed=args.seed))
    metrics = result.metrics()
    if args.json:
        print(json.dumps({**metrics.to_dict(), "num_errors": result.num_errors}))
        return 0 if not result.num_errors else 1
    print(f"{len(requests)} requests at {qps:.4g} req/s against {args.addr}")
    print(f"  errors            {result.num_errors}")
    print(f"  TTFT P50/P90/P99  {metrics.ttft_p50_s:.3f} / {metrics.ttft_p90_s:.3f} / "
          f"{metrics.ttft_p99_s:.3f} s")  # fmt: skip
    print(f"  TBT P50/P99       {metrics.tbt_p50_s * 1e3:.1f} / {metrics.tbt_p99_s * 1e3:.1f} ms")
    print(f"  sched delay P50   {metrics.scheduling_delay_p50_s:.3f} s")
    print(f"  throughput        {metrics.throughput_rps:.2f} req/s, "
          f"{metrics.throughput_tokens_s:.0f} tokens/s")  # fmt: skip
    print(f"  {metrics.stage_line()}")
    return 0 if not result.num_errors else 1
