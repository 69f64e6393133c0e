"""Progress of long benchmarks on stderr, one plain line per event.

Plain lines (no cursor tricks) read the same on a terminal and in CI logs, and stdout keeps only
the result: with --json, exactly one JSON document. The searches and simulations never print;
they take callbacks, and the commands turn what those hear into lines here.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

from sarathictl.bench.capacity import MAX_MEDIAN_DELAY_S, ProbeResult


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def seconds(value: float) -> str:
    """0.41 s, 0.0123 s, 12.3 s; n/a for NaN (no request made a second token)."""
    return "n/a" if math.isnan(value) else f"{value:.3g} s"


def rate(qps: float) -> str:
    return f"{qps:.4g} req/s"


def probe_line(
    label: str, probe: ProbeResult, tbt_slo_s: float, max_delay_s: float = MAX_MEDIAN_DELAY_S
) -> str:
    """`[vllm] probe 3: 0.275 req/s -> P99 TBT 0.41 s, median delay 0.3 s: meets SLO; took
    42.0 s`, with the bounds a miss breaks."""
    measured = (
        f"P99 TBT {seconds(probe.tbt_p99_s)}, median delay {seconds(probe.scheduling_delay_p50_s)}"
    )
    if probe.why_stopped:
        measured += " (of the requests done when it stopped)"
    if probe.passed:
        verdict = "meets SLO"
    elif probe.why_stopped:  # its figures are partial: what settled it says why
        verdict = f"misses SLO (stopped early: {probe.why_stopped})"
    else:
        why = []
        if not probe.tbt_p99_s <= tbt_slo_s:  # NaN included
            why.append(f"P99 TBT over {tbt_slo_s:.3g} s")
        if probe.scheduling_delay_p50_s > max_delay_s:
            why.append(f"median delay over {max_delay_s:g} s")
        if probe.stopped_early:
            why.append("stopped early")
        verdict = "misses SLO" + (f" ({', '.join(why)})" if why else "")
    took = "under 0.1 s" if probe.wall_s < 0.1 else f"{probe.wall_s:.1f} s"
    return f"[{label}] probe {probe.index}: {rate(probe.qps)} -> {measured}: {verdict}; took {took}"


def probe_printer(label: str, tbt_slo_s: float) -> Callable[[ProbeResult], None]:
    """An `on_probe` callback that prints each probe's line."""
    return lambda probe: say(probe_line(label, probe, tbt_slo_s))


class Periodic:
    """Calls `report(done)` at most once per `interval_s` of wall time: the progress of a long
    simulation, which reports every finished request."""

    def __init__(self, report: Callable[[int], None], interval_s: float) -> None:
        self.report = report
        self.interval_s = interval_s
        self.last_s = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last_s >= self.interval_s:
            self.last_s = now
            self.report(done)
