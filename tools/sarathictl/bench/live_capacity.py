"""Capacity of a live local cluster: one cluster per policy, bisection on the arrival rate.

Same definition as the simulated search (P99 TBT within the SLO, median scheduling delay within
2 s), measured on real processes: every probe replays the workload in real time, so keep
`num_requests` modest and the granularity coarser than in simulation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from controller.executor.simulated import SimRequest
from controller.scheduler.config import CHUNKED_POLICIES
from sarathictl.bench.capacity import CapacityResult, ProbeCallback, ProbeResult, search_capacity
from sarathictl.bench.live_load import replay, scale_requests
from sarathictl.bench.metrics import ServingMetrics
from sarathictl.bench.probe_steps import ProbeSteps, summarize
from sarathictl.bench.probe_verdict import ProbeBounds
from sarathictl.bench.progress import probe_line, rate, say
from sarathictl.bench.step_log_lines import lines_sent_since
from sarathictl.bench.workloads import WorkloadSpec, make_requests
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig
from sarathictl.slo_rule import SLO_BATCH, SLO_FACTORS


@dataclass
class PolicyCapacity:
    policy: str
    budget_tokens: int
    search: CapacityResult
    """The capacity found, the probes, and whether --search-time-s cut the search short."""
    at_capacity: ServingMetrics | None
    """Metrics of the highest passing probe."""
    controller_share_at_capacity: float | None = None
    """Controller time per micro-batch over a stage's, at the highest passing probe."""
    saturated: ServingMetrics | None = None
    """Metrics of one run at the saturating rate (every policy the same), if asked for: at
    capacity a CPU pipeline holds few requests, so its idle stages say little about balance."""
    probe_steps: list[tuple[float, ProbeSteps]] = field(default_factory=list)
    """(rate, what its steps cost) for each probe, in the order they ran."""

    @property
    def capacity_qps(self) -> float:
        return self.search.capacity_qps


def decode_step_s(cluster: LocalCluster, batch: int = SLO_BATCH, prompt_tokens: int = 64) -> float:
    """Median gap between tokens with `batch` requests decoding together (the paper's unit for
    SLOs: strict is 5x, relaxed 25x this)."""
    requests = [SimRequest(0.0, prompt_tokens, 24) for _ in range(batch)]
    run = asyncio.run(replay(cluster.addr, requests))
    gaps = [g for r in run.records for g in r.gaps_s[4:]]  # skip gaps while prompts still prefill
    return statistics.median(gaps)


def measure_policy(
    base: LocalClusterConfig,
    policy: str,
    budget_tokens: int,
    make_requests: Callable[[float], list[SimRequest]],
    slo: TbtSlo,
    initial_qps: float,
    granularity: float,
    saturation_qps: float = 0.0,
    on_probe: ProbeCallback | None = None,
    on_ready: Callable[[float], None] | None = None,
    search_time_s: float = 0.0,
) -> PolicyCapacity:
    """on_ready(P99 TBT bound in seconds) once the policy's cluster serves and the bound is
    known; on_probe after each probe (with what its steps cost, where the cluster logs them);
    search_time_s (0: none) ends the search before a probe that would end past that many
    seconds of it (capacity.py)."""
    config = with_budget(replace(base, policy=policy), budget_tokens)
    best: dict[float, tuple[ServingMetrics, float]] = {}
    probe_steps: list[tuple[float, ProbeSteps]] = []
    with LocalCluster(config) as cluster:
        tbt_slo_s = slo.on(cluster)
        asyncio.run(replay(cluster.addr, warmup_requests(make_requests(initial_qps))))
        if on_ready is not None:
            on_ready(tbt_slo_s)

        def passes(qps: float) -> ProbeResult:
            bounds = ProbeBounds(tbt_slo_s)
            started, offset = time.perf_counter(), step_log_size(cluster)
            run = asyncio.run(replay(cluster.addr, make_requests(qps), bounds=bounds))
            steps = None
            if config.step_log:
                steps = summarize(lines_sent_since(cluster.step_log_path, offset, started))
                probe_steps.append((qps, steps))
            metrics = run.metrics()
            ok = metrics.meets(tbt_slo_s)
            if ok:
                best[qps] = (metrics, run.controller_share_of_step)
            return ProbeResult(
                qps,
                ok,
                metrics.tbt_p99_s,
                metrics.scheduling_delay_p50_s,
                metrics.stopped_early,
                why_stopped=run.stop_reason,
                steps=steps,
            )

        result: CapacityResult = search_capacity(
            passes,
            initial_qps,
            granularity,
            min_qps=initial_qps * MIN_QPS_FRACTION,
            on_probe=on_probe,
            time_limit_s=search_time_s,
        )
        saturated = None
        if saturation_qps > 0:
            saturated = asyncio.run(replay(cluster.addr, make_requests(saturation_qps))).metrics()
    at_capacity, share = best.get(result.capacity_qps, (None, None))
    return PolicyCapacity(policy, budget_tokens, result, at_capacity, share, saturated, probe_steps)


def step_log_size(cluster: LocalCluster) -> int:
    """Bytes in the cluster's step log so far (0 where it keeps none)."""
    return cluster.step_log_path.stat().st_size if cluster.config.step_log else 0


MIN_PROBE_REQUESTS = 8
MIN_QPS_FRACTION = 1 / 32
"""The search stops halving below initial_qps times this (capacity then reads 0)."""


WARMUP_OUTPUT_TOKENS = 16


def warmup_requests(requests: list[SimRequest]) -> list[SimRequest]:
    """What a policy's cluster serves before its first probe: the longest and the shortest
    prompt of `requests` (the first probe's), together, up to 16 tokens each (no more than their
    own, so they stay within the model's length). First uses cost extra (kernels compiled for a
    shape, the allocator growing), and in a probe they would land in its P99 TBT."""
    by_prompt = sorted(requests, key=lambda r: r.num_prompt_tokens)
    return [
        SimRequest(0.0, r.num_prompt_tokens, min(r.num_output_tokens, WARMUP_OUTPUT_TOKENS))
        for r in (by_prompt[-1], by_prompt[0])
    ]


def cap_probe(requests: list[SimRequest], max_probe_s: float) -> list[SimRequest]:
    """The requests that arrive within max_probe_s (at least MIN_PROBE_REQUESTS): a probe at a
    low rate would otherwise replay for num_requests / qps seconds of real time."""
    if max_probe_s <= 0:
        return requests
    kept = [r for r in requests if r.arrival_s <= max_probe_s]
    return requests[: max(len(kept), MIN_PROBE_REQUESTS)]


def with_budget(config: LocalClusterConfig, budget_tokens: int) -> LocalClusterConfig:
    """config with this token budget; a chunked policy runs at most budget_tokens sequences
    (every decode must fit a micro-batch), so --max-num-seqs is capped there, not refused."""
    max_num_seqs = config.max_num_seqs
    if config.policy in CHUNKED_POLICIES and max_num_seqs > budget_tokens:
        max_num_seqs = budget_tokens
    return replace(config, budget_tokens=budget_tokens, max_num_seqs=max_num_seqs)


def run_local(args: argparse.Namespace) -> int:
    """`sarathictl bench capacity --local ...`: capacity of each policy on real processes."""
    policies: tuple[str, ...] = args.policies
    say(f"[live] model {args.model}: PP={args.pp} TP={args.tp}, policies {', '.join(policies)}")
    base = base_config(args)
    spec = WorkloadSpec(source=args.trace, num_requests=args.num_requests, seed=args.seed)

    def requests_at(qps: float) -> list[SimRequest]:
        requests = scale_requests(make_requests(spec, qps), args.scale, args.max_total_tokens)
        return cap_probe(requests, args.max_probe_s)

    started = time.perf_counter()
    slo = TbtSlo(args.tbt_slo, with_budget(base, args.budget))
    longest_tokens = longest_request_tokens(requests_at(1.0))
    results = []
    for policy in policies:
        budget = policy_budget_tokens(policy, args.budget, longest_tokens)
        results.append(search_policy_capacity(args, base, policy, budget, requests_at, slo))
    report = live_report(base, slo.seconds, slo.decode_s, results, time.perf_counter() - started)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_live_report(report, results)
    return 0


def base_config(args: argparse.Namespace) -> LocalClusterConfig:
    """The cluster every policy starts from (policy and budget are set per policy), on a free
    port (0) rather than the default 50051, logging its steps (what each probe's steps cost is
    reported beside its verdict). Without prefix caching: every probe replays the same
    prompts (one seed, so that rates differ only in their arrivals), which a cache would serve
    from the probe before (the paper's capacity has no cache; these prompts share nothing)."""
    from sarathictl.commands.up import resolve_model

    return LocalClusterConfig(
        model_dir=resolve_model(args.model),
        pp=args.pp,
        tp=args.tp,
        port=0,
        threads_per_worker=args.threads,
        max_num_seqs=args.max_num_seqs,
        device=args.device,
        dtype="float32" if args.device == "cpu" else "bfloat16",
        prefix_caching=False,
        step_log=True,
    )


class TbtSlo:
    """The P99 TBT bound every policy's search is held to: --tbt-slo seconds, or `strict` or
    `relaxed`: that multiple of the decode step of a batch of 32 (the paper's rule), measured
    once on `config` (the chunked policy at --budget). Where the first policy's cluster is that
    one, the step is measured there once it serves, not on a cluster started for it alone (a
    7B model's load and graph capture, on a GPU lent by the minute)."""

    def __init__(self, tbt_slo: float | str, config: LocalClusterConfig) -> None:
        self.factor = SLO_FACTORS.get(str(tbt_slo))
        self.name = str(tbt_slo)
        self.config = config
        self.seconds = math.nan if self.factor else float(tbt_slo)
        self.decode_s: float | None = None
        """The measured decode step (None: not measured, --tbt-slo gave seconds)."""

    def on(self, cluster: LocalCluster) -> float:
        """The bound in seconds, measured on `cluster` if it is not known yet and the cluster
        is the one to measure on, else on a cluster started for it."""
        if math.isnan(self.seconds):
            if cluster.config == self.config:
                self._measure(cluster)
            else:
                batch = SLO_BATCH
                say(f"[live] starting a cluster to measure the decode step of a batch of {batch}")
                with LocalCluster(self.config) as own:
                    self._measure(own)
        return self.seconds

    def _measure(self, cluster: LocalCluster) -> None:
        assert self.factor is not None
        self.decode_s = decode_step_s(cluster)
        self.seconds = self.factor * self.decode_s
        say(
            f"[live] decode step {self.decode_s:.3g} s: {self.name} SLO is P99 TBT <= "
            f"{self.seconds:.3g} s ({self.factor:g}x)"
        )


def longest_request_tokens(requests: list[SimRequest]) -> int:
    """Prompt plus output tokens of the longest request."""
    return max(r.num_prompt_tokens + r.num_output_tokens for r in requests)


def policy_budget_tokens(policy: str, chunked_budget_tokens: int, longest_tokens: int) -> int:
    """The token budget a policy runs with: --budget for the chunked policies, while the
    whole-prompt baselines batch prompts up to the longest request (rounded up to a multiple of
    32), as vLLM does."""
    if policy in ("sarathi", "chunked_only"):
        return chunked_budget_tokens
    return -(-longest_tokens // 32) * 32


def search_policy_capacity(
    args: argparse.Namespace,
    base: LocalClusterConfig,
    policy: str,
    budget_tokens: int,
    requests_at: Callable[[float], list[SimRequest]],
    slo: TbtSlo,
) -> PolicyCapacity:
    """measure_policy with its progress on stderr: when the cluster serves, each probe, the
    capacity found and, with --saturation-qps, the saturated run's bubbles."""
    say(f"[{policy}] starting a local cluster (budget {budget_tokens} tokens)")
    policy_started = time.perf_counter()

    def ready(tbt_slo_s: float) -> None:
        say(
            f"[{policy}] serving after {time.perf_counter() - policy_started:.1f} s; "
            f"searching from {rate(args.initial_qps)}, P99 TBT <= {tbt_slo_s:.3g} s"
        )

    result = measure_policy(
        base,
        policy,
        budget_tokens,
        requests_at,
        slo,
        args.initial_qps,
        args.granularity,
        args.saturation_qps,
        on_probe=partial(say_probe, policy, slo.seconds),
        on_ready=ready,
        search_time_s=args.search_time_s,
    )
    search = result.search
    unsure = (
        ""
        if search.converged
        else f", not converged: under {rate(search.upper_qps)}, --search-time-s ran out"
    )
    say(
        f"[{policy}] capacity {rate(search.capacity_qps)} after {len(search.probes)} probes "
        f"({time.perf_counter() - policy_started:.0f} s{unsure})"
    )
    if result.saturated is not None:
        s = result.saturated
        say(
            f"[{policy}] saturated at {rate(args.saturation_qps)}: bubbles "
            f"{s.bubble_fraction:.0%} (steady {s.steady_bubble_fraction:.0%}), "
            f"{s.throughput_tokens_s:.0f} tokens/s"
        )
    return result


def say_probe(policy: str, tbt_slo_s: float, probe: ProbeResult) -> None:
    """A probe's verdict on stderr, and on the next line what its steps cost."""
    say(probe_line(policy, probe, tbt_slo_s))
    if probe.steps is not None:
        say(f"[{policy}]   steps: {probe.steps.describe()}")


def live_report(
    base: LocalClusterConfig,
    tbt_slo_s: float,
    decode_s: float | None,
    results: list[PolicyCapacity],
    wall_s: float,
) -> dict[str, Any]:
    """The --json document: a row per policy (ratios to vllm where vllm ran), the whole run's
    wall time in seconds."""
    reference = next((r for r in results if r.policy == "vllm"), None)
    return {
        "model": base.model_dir,
        "pp": base.pp,
        "tp": base.tp,
        "tbt_slo_s": tbt_slo_s,
        "decode_step_batch32_s": decode_s,
        "results": [result_row(r, reference) for r in results],
        "wall_s": wall_s,
    }


def result_row(r: PolicyCapacity, reference: PolicyCapacity | None) -> dict[str, Any]:
    """One policy's row of the report; the at-capacity figures are None where no probe passed."""
    m = r.at_capacity
    return {
        "policy": r.policy,
        "budget_tokens": r.budget_tokens,
        "capacity_qps": r.capacity_qps,
        "upper_qps": r.search.upper_qps if math.isfinite(r.search.upper_qps) else None,
        "converged": r.search.converged,
        "ratio_to_vllm": (r.capacity_qps / reference.capacity_qps)
        if reference and reference.capacity_qps
        else None,
        "bubble_fraction_at_capacity": m.bubble_fraction if m else None,
        "steady_bubble_fraction_at_capacity": m.steady_bubble_fraction if m else None,
        "tbt_p99_s_at_capacity": m.tbt_p99_s if m else None,
        "controller_share_of_step_at_capacity": r.controller_share_at_capacity,
        "saturated": r.saturated.to_dict() if r.saturated else None,
        "probes": r.search.probes,
        "probe_steps": [(qps, steps.as_json()) for qps, steps in r.probe_steps],
    }


def print_live_report(report: dict[str, Any], results: list[PolicyCapacity]) -> None:
    """The report as text: a line per policy with its capacity, ratio and bubbles."""
    print(
        f"live capacity, {report['model']} PP={report['pp']} TP={report['tp']}, "
        f"P99 TBT <= {report['tbt_slo_s']:.3f} s"
    )
    for row, r in zip(report["results"], results, strict=True):
        ratio = row["ratio_to_vllm"]
        bubble = row["bubble_fraction_at_capacity"]
        steady = row["steady_bubble_fraction_at_capacity"]
        saturated = (
            f"  saturated: bubbles {r.saturated.bubble_fraction:.0%}, "
            f"{r.saturated.throughput_tokens_s:.0f} tokens/s"
            if r.saturated
            else ""
        )
        print(
            f"  {row['policy']:<14} {row['capacity_qps']:8.3f} qps"
            f"  {f'{ratio:.2f}x vllm' if isinstance(ratio, float) else '-':>12}"
            f"  bubbles {f'{bubble:.0%}' if isinstance(bubble, float) else '-'}"
            f" (steady {f'{steady:.0%}' if isinstance(steady, float) else '-'}){saturated}"
            + ("" if r.search.converged else f"  not converged: under {rate(r.search.upper_qps)}")
        )
