"""Serving metrics, one definition everywhere (README.md, "Metrics").

TTFT: arrival to first token. TBT: every gap between consecutive tokens of one request.
Scheduling delay: arrival to first scheduled. Each stage's wall time over the probe (first
arrival to last token) splits three ways, as `sarathictl status` and Prometheus split it:
utilization (busy), bubble (waiting while some request is in the system), idle (no request in
the system). Bubble fraction: bubble over busy plus bubble, the mean over stages (the
`pipeline_bubble_fraction` gauge). The steady-state bubble fraction is the same over the middle
80% of the arrivals, without ramp-up and drain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from controller.executor.simulated import SimulationResult
from controller.telemetry import StageShares


@dataclass(frozen=True)
class BusyWindow:
    """Each stage's busy seconds between two moments of a run."""

    start_s: float
    end_s: float
    stage_busy_s: tuple[float, ...]


def union_s(spans_s: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by at least one (start, end) span."""
    covered, reach = 0.0, lo
    for start, end in sorted(spans_s):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            covered += end - start
            reach = end
    return covered


def bubble_fraction(shares: Sequence[StageShares]) -> float:
    """Bubble over busy plus bubble, the mean over stages (0 without stages)."""
    return float(np.mean([s.bubble_fraction for s in shares])) if shares else 0.0


def window_shares(
    window: BusyWindow, request_spans_s: Sequence[tuple[float, float]]
) -> list[StageShares]:
    work_s = union_s(request_spans_s, window.start_s, window.end_s)
    span_s = window.end_s - window.start_s
    return [StageShares.of(busy, work_s, span_s) for busy in window.stage_busy_s]


@dataclass(frozen=True)
class ServingMetrics:
    num_requests: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    tbt_p99_s: float
    scheduling_delay_p50_s: float
    scheduling_delay_p99_s: float
    throughput_rps: float
    """Finished requests per second of wall (virtual) time."""
    throughput_tokens_s: float
    """Prompt plus output tokens processed per second."""
    stage_utilization: tuple[float, ...]
    stage_bubble: tuple[float, ...]
    """Share of the probe's wall time each stage waited while requests were in the system."""
    stage_idle: tuple[float, ...]
    """Share of the probe's wall time with no request in the system."""
    bubble_fraction: float
    """Bubble over busy plus bubble, mean over stages, over the whole probe."""
    steady_bubble_fraction: float
    """The same over the middle 80% of the arrivals (NaN: not measured)."""
    duration_s: float
    num_preemptions: int
    stopped_early: bool
    peak_kv_usage: float = float("nan")
    """Highest share of the KV cache's blocks in use (simulation; NaN: not measured)."""
    prefix_cached_token_share: float = float("nan")
    """Share of the admitted sequences' tokens the prefix cache gave them instead of computing
    them (simulation; 0 with the cache off; NaN: not measured)."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def stage_line(self, digits: int = 0) -> str:
        """Per stage utilization/bubble/idle, and the pipeline's bubble fractions."""
        pct = f".{digits}%"
        stages = ", ".join(
            f"{u:{pct}}/{b:{pct}}/{i:{pct}}"
            for u, b, i in zip(
                self.stage_utilization, self.stage_bubble, self.stage_idle, strict=True
            )
        )
        steady = (
            "-"
            if self.steady_bubble_fraction != self.steady_bubble_fraction  # NaN
            else f"{self.steady_bubble_fraction:{pct}}"
        )
        return (
            f"stages (util/bubble/idle) {stages}; bubble fraction {self.bubble_fraction:{pct}}"
            f" (steady state {steady})"
        )

    def meets(self, tbt_slo_s: float, max_median_delay_s: float = 2.0) -> bool:
        """The paper's capacity condition: P99 TBT within the SLO, median delay within 2 s."""
        return (
            not self.stopped_early
            and not self.tbt_p99_s > tbt_slo_s  # NaN: no request made a second token
            and self.scheduling_delay_p50_s <= max_median_delay_s
        )


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def summarize(result: SimulationResult) -> ServingMetrics:
    records = result.requests
    arrival = np.array([r.arrival_s for r in records])
    gaps = (
        np.frombuffer(result.tbt_gaps_s, dtype=np.float64)
        if len(result.tbt_gaps_s)
        else (np.zeros(0))
    )
    lo, hi = result.steady_window_s
    return serving_metrics(
        ttft_s=np.array([r.first_token_s for r in records]) - arrival,
        scheduling_delay_s=np.array([r.scheduled_s for r in records]) - arrival,
        tbt_gaps_s=gaps,
        probe=BusyWindow(result.start_s, result.end_s, tuple(result.stage_busy_s)),
        request_spans_s=[(r.arrival_s, r.finish_s) for r in records],
        num_tokens=sum(r.num_prompt_tokens + r.num_output_tokens for r in records),
        num_preemptions=result.num_preemptions,
        stopped_early=result.stopped_early,
        steady=BusyWindow(lo, hi, tuple(result.steady_stage_busy_s)) if hi > lo else None,
    )


def serving_metrics(
    ttft_s: np.ndarray,
    scheduling_delay_s: np.ndarray,
    tbt_gaps_s: np.ndarray,
    probe: BusyWindow,
    request_spans_s: Sequence[tuple[float, float]],
    num_tokens: int,
    num_preemptions: int,
    stopped_early: bool,
    steady: BusyWindow | None = None,
) -> ServingMetrics:
    """The metrics of one run from its per-request samples (simulated or live alike): probe is
    the whole run's stage busy time, request_spans_s each request's (arrival, finish), and steady
    the busy time over the middle of the arrivals."""
    duration = max(probe.end_s - probe.start_s, 1e-12)
    shares = window_shares(probe, request_spans_s)
    steady_shares = window_shares(steady, request_spans_s) if steady is not None else []
    return ServingMetrics(
        num_requests=len(ttft_s),
        ttft_p50_s=_pct(ttft_s, 50),
        ttft_p90_s=_pct(ttft_s, 90),
        ttft_p99_s=_pct(ttft_s, 99),
        tbt_p50_s=_pct(tbt_gaps_s, 50),
        tbt_p99_s=_pct(tbt_gaps_s, 99),
        scheduling_delay_p50_s=_pct(scheduling_delay_s, 50),
        scheduling_delay_p99_s=_pct(scheduling_delay_s, 99),
        throughput_rps=len(ttft_s) / duration,
        throughput_tokens_s=num_tokens / duration,
        stage_utilization=tuple(s.utilization for s in shares),
        stage_bubble=tuple(s.bubble for s in shares),
        stage_idle=tuple(s.idle for s in shares),
        bubble_fraction=bubble_fraction(shares),
        steady_bubble_fraction=bubble_fraction(steady_shares) if steady_shares else float("nan"),
        duration_s=duration,
        num_preemptions=num_preemptions,
        stopped_early=stopped_early,
    )
