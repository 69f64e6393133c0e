"""`sarathictl bench capacity`: each policy's capacity on one deployment, and its ratio to vllm."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from controller.simulator import AnalyticCostModel
from sarathictl.bench.capacity import MAX_MEDIAN_DELAY_S, CapacityResult, search_capacity
from sarathictl.bench.sim_args import add_setup_args, progress_bar, setup_from_args
from sarathictl.bench.sim_run import PreparedSim, SimSetup, prepare


def first_guess_qps(sim: PreparedSim) -> float:
    """Half the rate one stage could sustain with full 64-sequence decode batches and
    compute-bound prefills: a start within a few doublings of any policy's capacity."""
    model = sim.cost_model
    if not isinstance(model, AnalyticCostModel):
        return 1.0
    n = len(sim.unit_requests)
    prompt = sum(p for _, p, _ in sim.unit_requests) / n
    output = sum(o for _, _, o in sim.unit_requests) / n
    prefill_s = model.stage_time_s(int(prompt), 0.0)
    context = int(prompt + output / 2)
    decode_s = model.decode_step_s(64, context) / (64 * model.num_stages)
    return 0.5 / (prefill_s + output * decode_s)


def measure_capacity(
    setup: SimSetup,
    tbt_slo_s: float,
    initial_qps: float = 0.0,
    granularity: float = 0.025,
    on_probe: Callable[[float, bool], None] | None = None,
) -> CapacityResult:
    sim = prepare(setup)

    def passes(qps: float) -> bool:
        metrics = sim.run(qps, stop_delay_s=MAX_MEDIAN_DELAY_S)
        ok = metrics.meets(tbt_slo_s, MAX_MEDIAN_DELAY_S)
        if on_probe is not None:
            on_probe(qps, ok)
        return ok

    return search_capacity(passes, initial_qps or first_guess_qps(sim), granularity)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "capacity",
        help="highest arrival rate each policy serves within the SLOs (simulated)",
        description="Bisection on the Poisson arrival rate: P99 TBT within --tbt-slo and median "
        "scheduling delay within 2 s (Sarathi-Serve's definition), to --granularity.",
    )
    add_setup_args(parser)
    parser.add_argument("--policies", default="sarathi,vllm,orca", help="comma-separated")
    parser.add_argument(
        "--tbt-slo",
        required=True,
        help="P99 TBT target in seconds; with --local also `strict` or `relaxed` (5x or 25x the "
        "measured decode step of a batch of 32, the paper's rule)",
    )
    parser.add_argument("--granularity", type=float, default=0.025, help="relative precision")
    live = parser.add_argument_group("live (--local): real processes instead of the simulator")
    live.add_argument(
        "--local",
        action="store_true",
        help="start a local cluster per policy (--model is then a model folder or `demo`)",
    )
    live.add_argument("--scale", type=float, default=1.0, help="multiply trace lengths by this")
    live.add_argument("--initial-qps", type=float, default=1.0, help="first rate probed")
    live.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    live.add_argument(
        "--max-probe-s",
        type=float,
        default=120.0,
        help="replay only the requests arriving in this many seconds (at least 8; 0: all)",
    )
    live.add_argument(
        "--saturation-qps",
        type=float,
        default=0.0,
        help="also replay at this rate (above every capacity) for each policy and report its "
        "bubble fraction and throughput (0: skip)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.local:
        from sarathictl.bench.live_capacity import run_local

        return run_local(args)
    args.tbt_slo = float(args.tbt_slo)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ValueError("--policies lists no policy")
    results: dict[str, CapacityResult] = {}
    started = time.perf_counter()
    with progress_bar("capacity", None, not args.json) as bar:
        task = bar.task_ids[0]
        for policy in policies:

            def show(qps: float, ok: bool, policy: str = policy) -> None:
                verdict = "pass" if ok else "fail"
                bar.update(task, advance=1, description=f"{policy} {qps:.3f} qps {verdict}")

            setup = setup_from_args(args, policy)
            results[policy] = measure_capacity(setup, args.tbt_slo, 0.0, args.granularity, show)
    wall_s = time.perf_counter() - started
    reference = results.get("vllm")
    rows: list[dict[str, Any]] = []
    for policy, result in results.items():
        ratio = None
        if reference is not None and reference.capacity_qps > 0:
            ratio = result.capacity_qps / reference.capacity_qps
        rows.append(
            {
                "policy": policy,
                "capacity_qps": result.capacity_qps,
                "ratio_to_vllm": ratio,
                "num_probes": len(result.probes),
            }
        )
    if args.json:
        print(json.dumps({"tbt_slo_s": args.tbt_slo, "results": rows, "wall_s": wall_s}, indent=2))
        return 0
    print(
        f"{args.model} {args.tp}x{args.pp} {args.gpu} ({args.link}), {args.trace}, "
        f"P99 TBT <= {args.tbt_slo} s, median scheduling delay <= {MAX_MEDIAN_DELAY_S} s"
    )
    for row in rows:
        ratio = row["ratio_to_vllm"]
        ratio_text = f"{ratio:.2f}x vllm" if isinstance(ratio, float) else "-"
        print(f"  {row['policy']:<14} {row['capacity_qps']:8.3f} qps  {ratio_text}")
    print(f"  ({wall_s:.1f} s)")
    return 0
