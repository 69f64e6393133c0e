"""Per-stage utilization, bubble and idle from the workers' own busy time, and latency windows.

One definition everywhere: utilization is a stage's busy time over wall time; a bubble is time a
stage idles while the pipeline has work (requests waiting or running); idle is time with no work
at all. The three shares of a stage's wall time add up to 1.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sarathi_proto import stage_pb2


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0..1) of already sorted values by nearest rank; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


@dataclass
class StageTelemetry:
    """One stage, as its TP rank 0 reports it in heartbeats (ranks of a stage move together)."""

    stage: int
    window_s: float = 30.0
    host: str = ""
    device: str = ""
    """TP rank 0's device as its worker named it (cpu, cuda, cuda:N)."""
    tp_ranks: set[int] = field(default_factory=set)
    last_batch_id: int = 0
    last_heartbeat_time: float = 0.0
    busy_s_total: float = 0.0
    phases: stage_pb2.StepPhases | None = None
    """The step phases of the latest heartbeat that carried them (totals since start)."""
    # (time of report, busy seconds of that step)
    _steps: deque[tuple[float, float]] = field(default_factory=deque)

    def on_heartbeat(
        self, now: float, last_batch_id: int, step_busy_s: float, total: float
    ) -> None:
        self.last_heartbeat_time = now
        if last_batch_id > self.last_batch_id:
            self.last_batch_id = last_batch_id
            self._steps.append((now, step_busy_s))
        self.busy_s_total = total
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()

    def utilization(self, now: float, since: float) -> float:
        """Busy share of the window (or of the time since `since`, if shorter), in [0, 1]."""
        self._trim(now)
        span = min(self.window_s, now - since)
        if span <= 0:
            return 0.0
        return min(1.0, sum(busy for _, busy in self._steps) / span)

    def busy_s(self, now: float) -> float:
        """Busy seconds reported within the window."""
        self._trim(now)
        return sum(busy for _, busy in self._steps)

    def step_time_p50_s(self) -> float:
        return percentile(sorted(busy for _, busy in self._steps), 0.5)


class WorkWindow:
    """When the pipeline had work (requests waiting or running), over a recent window.

    The engine reports its state after every change; the window keeps the intervals with work.
    """

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._intervals: deque[tuple[float, float]] = deque()  # closed (start, end) with work
        self._open_since: float | None = None

    def mark(self, now: float, has_work: bool) -> None:
        if has_work and self._open_since is None:
            self._open_since = now
        elif not has_work and self._open_since is not None:
            self._intervals.append((self._open_since, now))
            self._open_since = None
            while self._intervals and self._intervals[0][1] < now - self.window_s:
                self._intervals.popleft()

    def work_s(self, now: float, since: float) -> float:
        """Seconds with work in the window (or since `since`, if later)."""
        start = max(now - self.window_s, since)
        total = sum(max(0.0, end - max(begin, start)) for begin, end in self._intervals)
        if self._open_since is not None:
            total += max(0.0, now - max(self._open_since, start))
        return total


@dataclass(frozen=True)
class StageShares:
    """A stage's wall time split three ways over the recent window; the shares add up to 1."""

    utilization: float
    bubble: float
    idle: float

    @classmethod
    def of(cls, busy_s: float, work_s: float, span_s: float) -> StageShares:
        if span_s <= 0:
            return cls(0.0, 0.0, 1.0)
        # Heartbeats report a step's busy time a little after it ran, so busy can exceed the work
        # time at the window's edges: clamp rather than report a negative bubble.
        utilization = min(1.0, busy_s / span_s)
        bubble = min(1.0 - utilization, max(0.0, work_s - busy_s) / span_s)
        return cls(utilization, bubble, max(0.0, 1.0 - utilization - bubble))

    @property
    def bubble_fraction(self) -> float:
        """Bubble over busy plus bubble: how much of the time with work the stage waited."""
        working = self.utilization + self.bubble
        return self.bubble / working if working > 0 else 0.0


class LatencyWindow:
    """Recent TTFT and TBT samples with their times, for status percentiles.

    Samples older than the window go as new ones come (status never reads them), so memory
    follows the rate over the last `window_s`, not the number of requests served: kept until
    `max_samples` pushed them out, the TTFT samples added ~110 bytes a request to the
    controller for its first 100,000 requests (the soak's drift in RELIABILITY.md).
    `max_samples` still caps a burst."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 100_000) -> None:
        self.window_s = window_s
        self._ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._tbt: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._tokens: deque[float] = deque(maxlen=max_samples)

    def add_ttft(self, now: float, ttft_s: float) -> None:
        self._ttft.append((now, ttft_s))
        self._tokens.append(now)
        self._drop_older(now)

    def add_tbt(self, now: float, tbt_s: float) -> None:
        self._tbt.append((now, tbt_s))
        self._tokens.append(now)
        self._drop_older(now)

    def _drop_older(self, now: float) -> None:
        cutoff = now - self.window_s
        for samples in (self._ttft, self._tbt):
            while samples and samples[0][0] < cutoff:
                samples.popleft()
        tokens = self._tokens
        while tokens and tokens[0] < cutoff:
            tokens.popleft()

    def _recent(self, samples: deque[tuple[float, float]], now: float) -> list[float]:
        cutoff = now - self.window_s
        return sorted(v for t, v in samples if t >= cutoff)

    def ttft(self, now: float) -> list[float]:
        return self._recent(self._ttft, now)

    def tbt(self, now: float) -> list[float]:
        return self._recent(self._tbt, now)

    def tokens_per_s(self, now: float, since: float) -> float:
        cutoff = now - self.window_s
        times = list(self._tokens)
        count = len(times) - bisect.bisect_left(times, cutoff)
        span = min(self.window_s, now - since)
        return count / span if span > 0 else 0.0
