"""Capacity: the highest arrival rate that meets the SLOs, found by bisection.

The paper's definition (section 5.1): P99 TBT within the SLO and median scheduling delay within
2 s. The search brackets the capacity geometrically from a first guess (doubling while the rate
passes, halving while it fails), then bisects until the bracket is within `granularity` of its
upper end. It assumes passing is monotone in the rate, which holds up to noise; with one seed
the workload's random numbers are shared by every rate (see workloads.py), which removes most of it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sarathictl.bench.probe_steps import ProbeSteps

logger = logging.getLogger(__name__)

MAX_MEDIAN_DELAY_S = 2.0


@dataclass(frozen=True)
class ProbeResult:
    """One rate tried by a capacity search, and what it measured."""

    qps: float
    passed: bool
    tbt_p99_s: float = math.nan
    """P99 time between tokens at this rate (NaN when the probe did not say)."""
    scheduling_delay_p50_s: float = math.nan
    stopped_early: bool = False
    """The run was cut short: its requests could no longer meet the delay bound (or failed)."""
    why_stopped: str = ""
    """What settled the miss of a run cut short, where the prober says (probe_verdict.py)."""
    index: int = 0
    """1 for the first probe of a search, 2 for the next, ..."""
    wall_s: float = 0.0
    """Wall time the probe took."""
    steps: ProbeSteps | None = None
    """What its steps cost, where the prober logged them (a live cluster's step log)."""


ProbeCallback = Callable[[ProbeResult], None]


@dataclass
class CapacityResult:
    capacity_qps: float
    """Highest rate seen to pass (0 if even the lowest probed rate failed)."""
    upper_qps: float
    """Lowest rate seen to fail (inf where none failed)."""
    probes: list[tuple[float, bool]] = field(default_factory=list)
    """(rate, passed) in the order they were run."""
    converged: bool = True
    """False when the search stopped at its time limit: the capacity lies in [capacity_qps,
    upper_qps], wider than the granularity asked."""


def search_capacity(
    passes: Callable[[float], bool | ProbeResult],
    initial_qps: float = 1.0,
    granularity: float = 0.025,
    min_qps: float = 1e-3,
    max_qps: float = 1e4,
    on_probe: ProbeCallback | None = None,
    time_limit_s: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> CapacityResult:
    """Bisection on the arrival rate until (upper - lower) <= granularity * upper.

    `passes(qps)` runs one probe: a verdict, or a ProbeResult with what it measured. `on_probe`
    hears of every probe as it ends (numbered, timed): the caller reports progress, not this.
    `time_limit_s` (0: none) ends the search before a probe that would end past it, guessing
    that the next probe takes as long as the longest so far, so that a search run under a
    deadline (a device lease, a CI job) still reports the bracket it found (converged False)."""
    if not 0 < granularity < 1:
        raise ValueError(f"granularity must be in (0, 1), got {granularity}")
    if not initial_qps > 0:
        raise ValueError(f"initial_qps must be > 0, got {initial_qps}")
    probes: list[tuple[float, bool]] = []
    started = clock()
    longest_s = 0.0

    def probe(qps: float) -> bool:
        nonlocal longest_s
        probe_started = clock()
        outcome = passes(qps)
        result = outcome if isinstance(outcome, ProbeResult) else ProbeResult(qps, bool(outcome))
        result = replace(result, index=len(probes) + 1, wall_s=clock() - probe_started)
        longest_s = max(longest_s, result.wall_s)
        probes.append((qps, result.passed))
        logger.debug("qps %.4f: %s", qps, "pass" if result.passed else "fail")
        if on_probe is not None:
            on_probe(result)
        return result.passed

    def out_of_time() -> bool:
        return time_limit_s > 0 and clock() - started + longest_s > time_limit_s

    # lower: the highest rate passed (0: none yet); upper: the lowest failed (inf: none yet).
    # Double from the first guess while every rate passes, halve while every rate fails, then
    # bisect the bracket.
    lower, upper = 0.0, math.inf
    qps = initial_qps
    while True:
        if probe(qps):
            lower = qps
        else:
            upper = qps
        if upper == math.inf:
            if qps * 2 > max_qps:
                return CapacityResult(lower, upper, probes)
            qps *= 2
        elif lower == 0.0:
            if qps / 2 < min_qps:
                return CapacityResult(0.0, upper, probes)
            qps /= 2
        elif upper - lower <= granularity * upper:
            return CapacityResult(lower, upper, probes)
        else:
            qps = (lower + upper) / 2
        if out_of_time():
            return CapacityResult(lower, upper, probes, converged=False)
