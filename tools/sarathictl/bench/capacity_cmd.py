"""`sarathictl bench capacity`: each policy's capacity on one deployment, and its ratio to vllm."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from controller.scheduler import policy_names
from controller.simulator import AnalyticCostModel
from sarathictl.argtypes import (
    NumberOrName,
    comma_list,
    device,
    float_above,
    float_at_least,
    float_in,
    int_at_least,
    one_of,
)
from sarathictl.bench.capacity import (
    MAX_MEDIAN_DELAY_S,
    CapacityResult,
    ProbeCallback,
    ProbeResult,
    search_capacity,
)
from sarathictl.bench.progress import probe_printer, rate, say
from sarathictl.bench.sim_args import add_setup_args, setup_from_args
from sarathictl.bench.sim_run import PreparedSim, SimSetup, prepare
from sarathictl.slo_rule import SLO_FACTORS


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
    on_probe: ProbeCallback | None = None,
    on_start: Callable[[PreparedSim, float], None] | None = None,
) -> CapacityResult:
    """on_start(sim, first rate) before the first probe; on_probe after each."""
    sim = prepare(setup)

    def passes(qps: float) -> ProbeResult:
        metrics = sim.run(qps, stop_delay_s=MAX_MEDIAN_DELAY_S)
        return ProbeResult(
            qps,
            metrics.meets(tbt_slo_s, MAX_MEDIAN_DELAY_S),
            metrics.tbt_p99_s,
            metrics.scheduling_delay_p50_s,
            metrics.stopped_early,
        )

    first_qps = initial_qps or first_guess_qps(sim)
    if on_start is not None:
        on_start(sim, first_qps)
    return search_capacity(passes, first_qps, granularity, on_probe=on_probe)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "capacity",
        help="highest arrival rate each policy serves within the SLOs (simulated)",
        description="Bisection on the Poisson arrival rate: P99 TBT within --tbt-slo and median "
        "scheduling delay within 2 s (Sarathi-Serve's definition), to --granularity.",
    )
    add_setup_args(parser)
    parser.add_argument(
        "--policies",
        type=comma_list(one_of("policy", policy_names())),
        default=("sarathi", "vllm", "orca"),
        help="comma-separated (default: sarathi,vllm,orca)",
    )
    parser.add_argument(
        "--tbt-slo",
        type=NumberOrName(float_above(0.0), tuple(SLO_FACTORS)),
        required=True,
        help="P99 TBT target in seconds; with --local also `strict` or `relaxed` (5x or 25x the "
        "measured decode step of a batch of 32, the paper's rule)",
    )
    parser.add_argument(
        "--granularity",
        type=float_in(0.0, 1.0, lo_open=True, hi_open=True),
        default=0.025,
        help="relative precision, in (0, 1)",
    )
    live = parser.add_argument_group("live (--local): real processes instead of the simulator")
    live.add_argument(
        "--local",
        action="store_true",
        help="start a local cluster per policy (--model is then a model folder or `demo`)",
    )
    live.add_argument(
        "--scale", type=float_above(0.0), default=1.0, help="multiply trace lengths by this"
    )
    live.add_argument("--initial-qps", type=float_above(0.0), default=1.0, help="first rate probed")
    live.add_argument("--threads", type=int_at_least(1), default=1, help="torch threads per worker")
    live.add_argument(
        "--device",
        type=device(),
        default="cpu",
        help="where the --local workers run: cpu (float32), cuda or cuda:N (bfloat16; workers "
        "that share a GPU link over gloo)",
    )
    live.add_argument(
        "--max-probe-s",
        type=float_at_least(0.0),
        default=120.0,
        help="replay only the requests arriving in this many seconds (at least 8 requests; 0: all)",
    )
    live.add_argument(
        "--search-time-s",
        type=float_at_least(0.0),
        default=0.0,
        help="end each policy's search before a probe that would end past this many seconds "
        "of it (the longest probe so far as the guess) and report the bracket found, marked "
        "not converged: for a run with a deadline (0: no limit)",
    )
    live.add_argument(
        "--saturation-qps",
        type=float_at_least(0.0),
        default=0.0,
        help="also replay at this rate (above every capacity) for each policy and report its "
        "bubble fraction and throughput (0: skip)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Simulated, or with --local on real processes (live_capacity.run_local)."""
    if args.local:
        from sarathictl.bench.live_capacity import run_local

        return run_local(args)
    if isinstance(args.tbt_slo, str):
        raise ValueError(
            f"--tbt-slo {args.tbt_slo} needs --local (it is a multiple of a measured decode "
            "step); in simulation give seconds"
        )
    started = time.perf_counter()
    results = {policy: search_simulated_capacity(args, policy) for policy in args.policies}
    wall_s = time.perf_counter() - started
    rows = capacity_rows(results)
    if args.json:
        print(json.dumps({"tbt_slo_s": args.tbt_slo, "results": rows, "wall_s": wall_s}, indent=2))
        return 0
    print_capacity_rows(args, rows, wall_s)
    return 0


def search_simulated_capacity(args: argparse.Namespace, policy: str) -> CapacityResult:
    """measure_capacity for one policy, with its progress on stderr: the first rate, each
    probe, and the capacity found."""
    policy_started = time.perf_counter()

    def start(sim: PreparedSim, first_qps: float) -> None:
        say(
            f"[{policy}] searching for the capacity from {rate(first_qps)}, "
            f"{len(sim.unit_requests)} requests per probe, P99 TBT <= {args.tbt_slo:g} s"
        )

    setup = setup_from_args(args, policy)
    result = measure_capacity(
        setup,
        args.tbt_slo,
        0.0,
        args.granularity,
        on_probe=probe_printer(policy, args.tbt_slo),
        on_start=start,
    )
    say(
        f"[{policy}] capacity {rate(result.capacity_qps)} after {len(result.probes)} probes "
        f"({time.perf_counter() - policy_started:.1f} s)"
    )
    return result


def capacity_rows(results: dict[str, CapacityResult]) -> list[dict[str, Any]]:
    """A row per policy: capacity in qps, its ratio to vllm's (None without a vllm capacity
    above 0) and the number of probes it took."""
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
    return rows


def print_capacity_rows(
    args: argparse.Namespace, rows: list[dict[str, Any]], wall_s: float
) -> None:
    """The rows as text under a line naming the deployment, workload and SLOs."""
    print(
        f"{args.model} {args.tp}x{args.pp} {args.gpu} ({args.link}), {args.trace}, "
        f"P99 TBT <= {args.tbt_slo} s, median scheduling delay <= {MAX_MEDIAN_DELAY_S} s"
    )
    for row in rows:
        ratio = row["ratio_to_vllm"]
        ratio_text = f"{ratio:.2f}x vllm" if isinstance(ratio, float) else "-"
        print(f"  {row['policy']:<14} {row['capacity_qps']:8.3f} qps  {ratio_text}")
    print(f"  ({wall_s:.1f} s)")
