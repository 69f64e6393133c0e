"""A cost model fitted to a live pipeline's step log (sarathictl.bench.calibrate): a stage
spends on a micro-batch of n tokens (prompt-chunk tokens and decodes together)

    tokens(n) + per decode x decodes + per prefill pair x (query, key) pairs of its prompt
    chunks + per decode key x the keys its decodes read,

and after the last stage the controller's turnaround passes before the next plan starts.

tokens(n) is what the linear layers and the rest of the forward pass cost for n rows, piecewise
linear between knots (powers of two up to the largest micro-batch seen) and extended past the
last by its slope. It is not one slope: on the 2-core CPU pipeline 1 token costs 10.0 ms, 4
cost 19.5, 16 cost 29.1, 64 cost 72.4 and 512 cost 475 (one of two stages of random
Falcon-shaped weights, one thread each; BENCHMARKS.md), so a fixed cost plus a per-token slope
is either far high for a lone decode or far low for four. Attention is per pair: a prompt
chunk's grows with its square, a decode's with its context. A lone prompt of n tokens has
n (n + 1) / 2 prefill pairs; d decodes at context k read d (k + 1) keys.

Every unknown enters linearly (a knot's value weighs a row by where its n falls between two
knots), so the fit is one least-squares problem with every value >= 0
(step_cost_fit.nonnegative_fit), each row weighed by its own time so that 10 ms decode steps
and 500 ms prompts fit alike."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from controller.scheduler import MicroBatch
from controller.scheduler.step_cost import micro_batch_features
from controller.simulator.cost_model import StageCost
from controller.simulator.step_cost_fit import nonnegative_fit

ProfileRow = tuple[int, int, int, int, float]
"""(prompt tokens, decodes, prefill pairs, decode keys, one stage's seconds) of a micro-batch."""


def knot_weights(n: int, knots: Sequence[int]) -> list[float]:
    """How much each knot's value counts towards tokens(n): linear interpolation between the two
    knots around n; below the first knot its value; past the last, the last segment extended."""
    weights = [0.0] * len(knots)
    if len(knots) == 1 or n <= knots[0]:
        weights[0] = 1.0
        return weights
    i = min(bisect_left(knots, n) - 1, len(knots) - 2)  # knots[i] < n <= knots[i + 1]
    t = (n - knots[i]) / (knots[i + 1] - knots[i])
    weights[i], weights[i + 1] = 1.0 - t, t
    return weights


@dataclass(frozen=True)
class StageCoefficients:
    token_knots: tuple[int, ...]
    """Token counts, rising, the first >= 1."""
    knot_s: tuple[float, ...]
    """tokens(n) at each knot, seconds."""
    per_decode_s: float = 0.0
    per_prefill_pair_s: float = 0.0
    per_decode_key_s: float = 0.0
    turnaround_s: float = 0.0
    """Per micro-batch, on no stage: from the last stage's end until the next plan, sent once
    this result is applied, starts on stage 0 (the result's trip, the controller's apply and
    schedule, the plan's trip). With PP micro-batches in flight it idles every stage."""

    def __post_init__(self) -> None:
        knots = self.token_knots
        if not knots or knots[0] < 1 or any(b <= a for a, b in pairwise(knots)):
            raise ValueError(f"token_knots must rise from >= 1, got {knots}")
        if len(self.knot_s) != len(knots):
            raise ValueError(f"knot_s has {len(self.knot_s)} values for {len(knots)} knots")
        named = {f"knot_s[{i}]": v for i, v in enumerate(self.knot_s)} | {
            name: getattr(self, name)
            for name in ("per_decode_s", "per_prefill_pair_s", "per_decode_key_s", "turnaround_s")
        }
        for name, value in named.items():
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")

    def tokens_s(self, n: int) -> float:
        weights = knot_weights(n, self.token_knots)
        return max(0.0, sum(w * v for w, v in zip(weights, self.knot_s, strict=True)))

    def stage_time_s(
        self, prompt_tokens: int, decodes: int, prefill_pairs: int, decode_keys: int
    ) -> float:
        return (
            self.tokens_s(prompt_tokens + decodes)
            + self.per_decode_s * decodes
            + self.per_prefill_pair_s * prefill_pairs
            + self.per_decode_key_s * decode_keys
        )


def fit_knots(token_counts: Sequence[int]) -> tuple[int, ...]:
    """Powers of two below the largest count, and the largest; a knot without a count strictly
    between its neighbours is dropped (the fit could not pin its value)."""
    top = max(token_counts)
    knots = [1 << k for k in range(top.bit_length()) if (1 << k) < top] + [top]
    counts = np.unique(np.asarray(token_counts))
    while True:
        around = [-np.inf, *knots, np.inf]  # knot i lies between around[i] and around[i + 2]
        kept = [
            k
            for i, k in enumerate(knots)
            if ((counts > around[i]) & (counts < around[i + 2])).any()
        ]
        if kept == knots:
            return tuple(knots)
        knots = kept


def fit_rows(rows: Sequence[ProfileRow]) -> StageCoefficients:
    """The profile that fits rows best in relative error (turnaround_s is measured apart)."""
    if len(rows) < 8:
        raise ValueError(f"a profile needs at least 8 micro-batches, got {len(rows)}")
    tokens = [p + d for p, d, *_ in rows]
    knots = fit_knots(tokens)
    features = np.array(
        [
            [*knot_weights(n, knots), d, pairs, keys]
            for n, (_, d, pairs, keys, _) in zip(tokens, rows, strict=True)
        ]
    )
    times = np.array([row[4] for row in rows])
    if (times <= 0).any():
        raise ValueError("every micro-batch's time must be > 0")
    coef = nonnegative_fit(features / times[:, None], np.ones(len(rows)))
    k = len(knots)
    return StageCoefficients(knots, tuple(coef[:k]), *coef[k:])


class LinearProfile:
    """Every stage costs the same (a stage's measured share); transfers are in the times, and
    the controller's turnaround follows the last stage."""

    def __init__(self, coefficients: StageCoefficients, num_stages: int = 1) -> None:
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        self.coefficients = coefficients
        self.num_stages = num_stages

    def micro_batch_cost(self, batch: MicroBatch) -> StageCost:
        c = self.coefficients
        time_s = c.stage_time_s(*micro_batch_features(batch))
        return StageCost([time_s] * self.num_stages, 0.0, c.turnaround_s)
