"""A cost model fitted to a live pipeline's measurements: every stage costs
fixed + per prompt token x prompt tokens + per decode x decodes
+ per prefill pair x a prompt chunk's (query, key) pairs + per decode key x the keys decodes read.

Prompt and decode tokens get a coefficient each, and so do their attention: a prompt's tokens
and attention are compute-bound, a handful of decodes is memory-bound (the weights are read once
whatever the count; each decode reads its whole context), and on the CPU pipeline the two differ
several-fold per token and by orders of magnitude per attended pair, so the scheduler's
three-number StepCostModel fits neither well. A lone prompt of n tokens has n (n + 1) / 2
prefill pairs; d decodes at context k read d (k + 1) keys. The fit is least squares with every
coefficient >= 0 (step_cost_fit.nonnegative_fit)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from controller.scheduler import MicroBatch
from controller.scheduler.step_cost import attended
from controller.simulator.cost_model import StageCost
from controller.simulator.step_cost_fit import nonnegative_fit

ProfileRow = tuple[int, int, int, int, float]
"""(prompt tokens, decodes, prefill pairs, decode keys, one stage's seconds) of a micro-batch."""


@dataclass(frozen=True)
class StageCoefficients:
    fixed_s: float
    per_prompt_token_s: float
    per_decode_s: float
    per_prefill_pair_s: float
    per_decode_key_s: float

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")

    def stage_time_s(
        self, prompt_tokens: int, decodes: int, prefill_pairs: int, decode_keys: int
    ) -> float:
        return (
            self.fixed_s
            + self.per_prompt_token_s * prompt_tokens
            + self.per_decode_s * decodes
            + self.per_prefill_pair_s * prefill_pairs
            + self.per_decode_key_s * decode_keys
        )


def fit_rows(
    rows: Sequence[ProfileRow], first_token: Sequence[bool] = ()
) -> tuple[StageCoefficients, float]:
    """The coefficients, and the extra seconds of the rows flagged first_token: a time to first
    token also holds the request's admission and its first sampling, which no later step pays,
    so it gets its own term instead of inflating every step's fixed cost."""
    flags = list(first_token) or [False] * len(rows)
    if len(flags) != len(rows):
        raise ValueError(f"first_token has {len(flags)} flags for {len(rows)} rows")
    columns = 5 + (any(flags) and not all(flags))
    if len(rows) < columns:
        raise ValueError(f"a linear profile needs at least {columns} rows, got {len(rows)}")
    features = np.array([(1.0, *row[:4], float(f)) for row, f in zip(rows, flags, strict=True)])
    times = np.array([t for *_, t in rows])
    coef = nonnegative_fit(features[:, :columns], times)
    return StageCoefficients(*coef[:5]), (coef[5] if columns == 6 else 0.0)


class LinearProfile:
    """Every stage costs the same (a stage's measured share); transfers are in the times."""

    def __init__(self, coefficients: StageCoefficients, num_stages: int = 1) -> None:
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        self.coefficients = coefficients
        self.num_stages = num_stages

    def micro_batch_cost(self, batch: MicroBatch) -> StageCost:
        prompt_tokens = decodes = prefill_pairs = decode_keys = 0
        block = batch.decodes
        if block is not None:  # a decode at position p reads p + 1 keys
            decodes = len(block.seq_ids)
            decode_keys = int(block.positions.sum()) + decodes
        for chunk in batch.other_chunks:
            if chunk.num_tokens == 1 and chunk.first_position > 0:
                decodes += 1
                decode_keys += chunk.first_position + 1
            else:
                prompt_tokens += chunk.num_tokens
                prefill_pairs += attended(chunk.first_position, chunk.num_tokens)
        time_s = self.coefficients.stage_time_s(prompt_tokens, decodes, prefill_pairs, decode_keys)
        return StageCost([time_s] * self.num_stages, 0.0)
