"""The simulator against the live pipeline (issue 17): calibrate on a live CPU cluster, predict
each policy's capacity at the strict SLO and its P99 TBT, median TTFT and bubble fraction at a
fixed rate, then measure the same live.

`python -m sarathictl.bench.validate --model DIR --trace splitwise --scale 0.25 --pp 2 ...`
A first cluster is calibrated (calibrate.py, from the controller's step log; sarathi with a
budget that holds the longest request, so that lone prompts run whole) and its measured decode
step of a batch of 32 sets the strict SLO (5x) for every policy, live and simulated. Then one
cluster per policy, whose step log also gives the fitted profile's error on the micro-batches
that policy really ran at the fixed rate. The
scaled requests are written once as a trace with arrival times and replayed by both sides
(simulator and live), so they see the same requests at the same times. Live capacity is checked
where the target puts it: a probe at (1 - tolerance) and one at (1 + tolerance) times the
prediction (pass, then fail, means the live capacity lies within the tolerance), each repeated;
the fixed-rate point (a share of the lowest predicted capacity) is repeated too, medians and
spread reported. Each policy's result is appended to --out as one JSON line as it ends; the
scaled trace and the step logs are kept in a folder beside it."""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from controller.simulator.linear_profile import StageCoefficients
from sarathictl.bench.calibrate import Calibration, calibrate, fit_error, profile_rows
from sarathictl.bench.capacity_cmd import measure_capacity
from sarathictl.bench.live_capacity import with_budget
from sarathictl.bench.live_load import replay, scale_requests
from sarathictl.bench.metrics import ServingMetrics
from sarathictl.bench.sim_run import SimSetup, prepare
from sarathictl.bench.step_log_lines import read_step_log
from sarathictl.bench.workloads import WorkloadSpec, make_requests
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig
from sarathictl.slo_rule import SLO_FACTORS

POLICIES = ("sarathi", "vllm", "orca")


def say(line: str) -> None:
    print(f"[validate] {line}", file=sys.stderr, flush=True)


def write_scaled_trace(args: argparse.Namespace, folder: Path) -> tuple[WorkloadSpec, int]:
    """The workload's requests at unit rate, lengths scaled, as a replayable trace; and the
    longest request (whole-prompt baselines batch up to it)."""
    spec = WorkloadSpec(source=args.trace, num_requests=args.num_requests, seed=args.seed)
    requests = scale_requests(make_requests(spec, 1.0), args.scale, args.max_total_tokens)
    path = folder / f"{Path(args.trace).stem}-x{args.scale:g}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        for r in requests:
            writer.writerow([f"{r.arrival_s:.6f}", r.num_prompt_tokens, r.num_output_tokens])
    replayed = WorkloadSpec(source=str(path), num_requests=len(requests), arrival="replay")
    return replayed, max(r.num_prompt_tokens + r.num_output_tokens for r in requests)


def budget_for(policy: str, args: argparse.Namespace, longest: int) -> int:
    return args.budget if policy == "sarathi" else -(-longest // 32) * 32


def summary(m: ServingMetrics) -> dict[str, float]:
    return {
        "tbt_p99_s": m.tbt_p99_s,
        "ttft_p50_s": m.ttft_p50_s,
        "bubble_fraction": m.bubble_fraction,
        "scheduling_delay_p50_s": m.scheduling_delay_p50_s,
    }


def predict(
    spec: WorkloadSpec, cal: Calibration, pp: int, budgets: dict[str, int], slo_s: float
) -> dict[str, dict[str, Any]]:
    """Each policy's simulated capacity at the SLO, on the calibrated profile."""
    out: dict[str, dict[str, Any]] = {}
    for policy, budget in budgets.items():
        setup = SimSetup(
            pp=pp, policy=policy, budget_tokens=budget, baseline_budget_tokens=budget,
            workload=spec, stage_coefficients=cal.coefficients,
            orca_as_published=False,
        )  # fmt: skip
        result = measure_capacity(setup, slo_s, initial_qps=1.0, granularity=0.02)
        out[policy] = {"capacity_qps": result.capacity_qps, "setup": setup}
        say(f"[{policy}] predicted capacity {result.capacity_qps:.3f} req/s")
    return out


def live_runs(addr: str, spec: WorkloadSpec, qps: float, repeats: int) -> list[ServingMetrics]:
    return [asyncio.run(replay(addr, make_requests(spec, qps))).metrics() for _ in range(repeats)]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_policy_live(
    cluster: LocalCluster,
    spec: WorkloadSpec,
    predicted_qps: float,
    fixed_qps: float,
    slo_s: float,
    args: argparse.Namespace,
    step_log: Path,
    coefficients: StageCoefficients,
) -> dict[str, Any]:
    """Fixed-rate runs, and the capacity check around the prediction, repeated; the profile's
    error on the fixed-rate runs' micro-batches (the cluster's step log)."""
    offset = step_log.stat().st_size
    fixed = live_runs(cluster.addr, spec, fixed_qps, args.repeats)
    out: dict[str, Any] = {
        "fixed": {k: spread([summary(m)[k] for m in fixed]) for k in summary(fixed[0])},
        "profile_error": fit_error(profile_rows(read_step_log(step_log, offset)), coefficients),
    }
    for name, factor in (("below", 1 - args.tolerance), ("above", 1 + args.tolerance)):
        qps = predicted_qps * factor
        runs = live_runs(cluster.addr, spec, qps, args.edge_repeats)
        passed = [m.meets(slo_s) for m in runs]
        out[name] = {"qps": qps, "passed": passed, "tbt_p99_s": [m.tbt_p99_s for m in runs],
                     "delay_p50_s": [m.scheduling_delay_p50_s for m in runs]}  # fmt: skip
        say(f"  {name} {qps:.3f} req/s: {passed}, P99 TBT {[round(m.tbt_p99_s, 3) for m in runs]}")
    return out


def append(path: Path, report: dict[str, Any]) -> None:
    """One JSON line per finished policy (the latest line of a configuration is the fullest),
    so that an interrupted run keeps what it measured."""
    with open(path, "a") as f:
        f.write(json.dumps(report, default=str) + "\n")


def calibrate_on_live(
    args: argparse.Namespace, folder: Path, budget: int
) -> tuple[Calibration, float]:
    """The calibration, on a cluster of its own; and the strict SLO it measures."""
    step_log = folder / "calibration-steps.jsonl"
    step_log.touch()
    config = with_budget(cluster_config(args, "sarathi", step_log), budget)
    with LocalCluster(config) as cluster:
        say(f"calibrating on the live cluster (PP={args.pp}, budget {budget})")
        cal = calibrate(cluster.addr, step_log, args.repeats, say)
    slo_s = SLO_FACTORS["strict"] * cal.decode32_gap_s
    say(f"strict SLO: P99 TBT <= {slo_s:.3f} s")
    return cal, slo_s


def cluster_config(args: argparse.Namespace, policy: str, step_log: Path) -> LocalClusterConfig:
    """Without prefix caching: the repeats and the calibration replay the same prompts, which a
    cache would serve from the run before, while the simulated runs they are held against share
    nothing."""
    return LocalClusterConfig(
        model_dir=args.model, pp=args.pp, port=0, threads_per_worker=1, policy=policy,
        extra_controller_args=("--step-log", str(step_log)), prefix_caching=False,
    )  # fmt: skip


def validate(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    spec, longest = write_scaled_trace(args, folder)
    budgets = {p: budget_for(p, args, longest) for p in args.policies}
    report: dict[str, Any] = {"trace": args.trace, "scale": args.scale, "pp": args.pp,
                              "num_requests": spec.num_requests, "seed": args.seed,
                              "max_total_tokens": args.max_total_tokens,
                              "budgets": budgets}  # fmt: skip
    cal, slo_s = calibrate_on_live(args, folder, budget_for("vllm", args, longest))
    predictions = predict(spec, cal, args.pp, budgets, slo_s)
    fixed_qps = args.fixed_share * min(p["capacity_qps"] for p in predictions.values())
    report |= {"slo_s": slo_s, "fixed_qps": fixed_qps, "calibration": {
        "num_rows": len(cal.rows), "fit_error": cal.fit_error,
        "coefficients": vars(cal.coefficients)}}  # fmt: skip
    for policy in args.policies:
        started = time.perf_counter()
        step_log = folder / f"{policy}-steps.jsonl"
        step_log.touch()
        config = with_budget(cluster_config(args, policy, step_log), budgets[policy])
        with LocalCluster(config) as cluster:
            predicted = predictions[policy]["capacity_qps"]
            say(f"[{policy}] live: fixed rate {fixed_qps:.3f} req/s x{args.repeats}, then "
                f"{predicted:.3f} req/s x (1 -/+ {args.tolerance:g})")  # fmt: skip
            live = measure_policy_live(
                cluster, spec, predicted, fixed_qps, slo_s, args, step_log, cal.coefficients
            )
        sim = prepare(predictions[policy]["setup"])
        report[policy] = {
            "predicted_capacity_qps": predicted,
            "simulated": summary(sim.run(fixed_qps)),
            # The probes' rates simulated too: capacity hangs on the median scheduling delay,
            # which a short run's burst makes flat in the rate, so compare it where measured.
            "simulated_probes": {
                name: summary(sim.run(live[name]["qps"])) for name in ("below", "above")
            },
            "live": live,
            "wall_s": time.perf_counter() - started,
        }
        append(args.out, {k: v for k, v in report.items()})
        say(f"[{policy}] done in {time.perf_counter() - started:.0f} s: {live['fixed']}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sarathictl.bench.validate", description=__doc__)
    p.add_argument("--model", required=True, help="model folder (sarathictl model random-falcon)")
    p.add_argument("--trace", default="splitwise")
    p.add_argument("--scale", type=float, default=0.25, help="multiply lengths by this")
    p.add_argument("--max-total-tokens", type=int, default=1024)
    p.add_argument("--num-requests", type=int, default=24, help="per live run and simulation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--budget", type=int, default=64, help="sarathi's token budget")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--repeats", type=int, default=3, help="live runs per fixed-rate point")
    p.add_argument("--edge-repeats", type=int, default=1, help="live runs per capacity edge")
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--fixed-share", type=float, default=0.7, help="of the lowest prediction")
    p.add_argument("--out", type=Path, required=True, help="append the JSON report here")
    args = p.parse_args(argv)
    args.policies = tuple(args.policies.split(","))
    # The scaled trace and every cluster's step log stay beside the report, to look into misses.
    folder = (
        args.out.parent / f"{args.out.stem}-{Path(args.trace).stem}-x{args.scale:g}-pp{args.pp}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    say(f"the trace and the step logs go to {folder}")
    validate(args, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
