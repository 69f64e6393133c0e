"""Serving metrics, one definition everywhere (README.md, "Metrics").

TTFT: arrival to first token. TBT: every gap between consecutive tokens of one request.
Scheduling delay: arrival to first scheduled. Stage utilization: busy time over the time requests
are in the system (first arrival to last token); bubble fraction: 1 - mean utilization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from controller.executor.simulated import SimulationResult


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
    bubble_fraction: float
    duration_s: float
    num_preemptions: int
    stopped_early: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

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
    return serving_metrics(
        ttft_s=np.array([r.first_token_s for r in records]) - arrival,
        scheduling_delay_s=np.array([r.scheduled_s for r in records]) - arrival,
        tbt_gaps_s=gaps,
        duration_s=result.end_s - result.start_s,
        stage_busy_s=result.stage_busy_s,
        num_tokens=sum(r.num_prompt_tokens + r.num_output_tokens for r in records),
        num_preemptions=result.num_preemptions,
        stopped_early=result.stopped_early,
    )


def serving_metrics(
    ttft_s: np.ndarray,
    scheduling_delay_s: np.ndarray,
    tbt_gaps_s: np.ndarray,
    duration_s: float,
    stage_busy_s: Sequence[float],
    num_tokens: int,
    num_preemptions: int,
    stopped_early: bool,
) -> ServingMetrics:
    """The metrics of one run from its per-request samples (simulated or live alike)."""
    duration = max(duration_s, 1e-12)
    utilization = tuple(min(1.0, busy / duration) for busy in stage_busy_s)
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
        stage_utilization=utilization,
        # Clamped: float rounding can push a saturated pipeline's utilization past 1.
        bubble_fraction=max(0.0, 1.0 - float(np.mean(utilization))) if utilization else 0.0,
        duration_s=duration,
        num_preemptions=num_preemptions,
        stopped_early=stopped_early,
    )
