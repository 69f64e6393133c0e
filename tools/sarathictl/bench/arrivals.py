"""Arrival processes: Poisson, gamma (bursty), a recorded trace's own times, and a rate curve.

Arrivals are drawn at a mean rate of 1 request/s and divided by the QPS (common random numbers,
workloads.py). A rate curve (diurnal load) then bends time: with relative rates r(t) of mean 1
over a period, the arrival at unit time u / qps lands at C^-1(u / qps), C(t) the integral of r
from 0 to t; so the process keeps its mean rate, qps, and its rate at t is qps * r(t). The curve
is piecewise constant over equal slices of the period, which makes C piecewise linear and its
inverse exact (np.interp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ARRIVALS = ("poisson", "gamma", "replay")

# Relative rates per hour of a day, peak mid-afternoon and trough before dawn (3:1): the shape
# of an interactive service's load, for `--rate-curve diurnal`.
DIURNAL_RATES = tuple(
    round(1.0 + 0.5 * math.cos(2 * math.pi * (hour - 15) / 24), 3) for hour in range(24)
)


def unit_gaps(arrival: str, burstiness: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n gaps of mean 1 s: exponential (Poisson) or gamma with squared CV `burstiness`."""
    if arrival == "poisson":
        return rng.exponential(1.0, n)
    if arrival == "gamma":
        shape = 1.0 / burstiness
        return rng.gamma(shape, 1.0 / shape, n)
    raise ValueError(f"arrival must be poisson or gamma to draw gaps, got {arrival!r}")


def unit_rate_times(recorded_s: list[float]) -> tuple[list[float], float]:
    """A recorded trace's arrivals rescaled to a mean rate of 1 request/s, and its own mean
    rate (requests over the span from the first arrival to the last)."""
    n = len(recorded_s)
    span = recorded_s[-1] - recorded_s[0] if n > 1 else 0.0
    if not span > 0:
        raise ValueError("a replayed trace needs at least two distinct arrival times")
    recorded_qps = (n - 1) / span
    return [(t - recorded_s[0]) * recorded_qps for t in recorded_s], recorded_qps


@dataclass(frozen=True)
class RateCurve:
    relative_rates: tuple[float, ...]
    """Rates over equal slices of the period, relative (normalized to a mean of 1)."""
    period_s: float

    def __post_init__(self) -> None:
        if not self.relative_rates:
            raise ValueError("rate_curve needs at least one rate")
        if any(not r > 0 for r in self.relative_rates):
            raise ValueError(f"rate_curve rates must be > 0, got {self.relative_rates}")
        if not self.period_s > 0:
            raise ValueError(f"rate_period_s must be > 0, got {self.period_s}")

    def _knots(self) -> tuple[np.ndarray, np.ndarray]:
        """(t, C(t)) at the slice edges of one period; C(period) = period."""
        rates = np.asarray(self.relative_rates, dtype=np.float64)
        rates = rates / rates.mean()
        slice_s = self.period_s / len(rates)
        t = np.arange(len(rates) + 1) * slice_s
        c = np.concatenate(([0.0], np.cumsum(rates * slice_s)))
        return t, c

    def warp(self, times_s: np.ndarray) -> np.ndarray:
        """C^-1 of times at a flat rate: the same arrivals under the curve."""
        t_knots, c_knots = self._knots()
        periods = np.floor(times_s / self.period_s)
        within = times_s - periods * self.period_s
        return periods * self.period_s + np.interp(within, c_knots, t_knots)

    def rate_at(self, t_s: float) -> float:
        """Relative rate at t (for reports and tests)."""
        rates = np.asarray(self.relative_rates, dtype=np.float64)
        slot = int((t_s % self.period_s) / self.period_s * len(rates))
        return float(rates[min(slot, len(rates) - 1)] / rates.mean())
