"""The scheduler's StepCostModel fitted to a stage cost model (analytic or measured): least
squares over micro-batches like those the scheduler builds: prompt chunks early and late in long
prompts, decode batches over short and long contexts, and the two mixed."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from controller.scheduler import MicroBatch, ScheduledChunk
from controller.scheduler.step_cost import StepCostModel, attended
from controller.simulator.cost_model import StageCost


class CostModel(Protocol):
    def micro_batch_cost(self, batch: MicroBatch) -> StageCost: ...


def _batch(chunks: list[tuple[int, int]]) -> MicroBatch:
    """(first_position, num_tokens) per chunk; each yields a token, as a chunk ending a prompt
    or a decode does."""
    records = [ScheduledChunk(i, p, n, True, (), [0] * n, None) for i, (p, n) in enumerate(chunks)]
    return MicroBatch(0, records, [], sum(n for _, n in chunks))


def sample_batches(max_tokens: int, max_context: int) -> list[MicroBatch]:
    """Micro-batches of up to max_tokens tokens whose chunks reach up to max_context."""
    sizes = sorted({max(1, max_tokens * k // 8) for k in range(1, 9)})
    positions = sorted({max_context * k // 4 for k in range(4)})
    batches = []
    for n in sizes:
        for p in positions:
            batches.append(_batch([(p, n)]))  # a prompt chunk
            decodes = [(max(p, 1), 1)] * n
            batches.append(_batch(decodes))  # n decodes over a context of about p
            half = max(1, n // 2)
            batches.append(_batch([(p, half), *[(max(p, 1), 1)] * (n - half)]))  # mixed
    return batches


def fit_step_cost(cost_model: CostModel, max_tokens: int, max_context: int) -> StepCostModel:
    """The slowest stage's time of each sampled micro-batch against (1, tokens, attended pairs);
    a coefficient the fit makes negative is dropped and the rest refitted."""
    batches = sample_batches(max_tokens, max_context)
    features = np.array(
        [
            (1.0, b.num_tokens, sum(attended(c.first_position, c.num_tokens) for c in b.chunks))
            for b in batches
        ]
    )
    times = np.array([max(cost_model.micro_batch_cost(b).stage_times_s) for b in batches])
    fixed, per_token, per_attended = nonnegative_fit(features, times)
    if per_token == 0:
        per_token = float(times.mean() / features[:, 1].mean())
    return StepCostModel(fixed, per_token, per_attended)


def nonnegative_fit(features: np.ndarray, times: np.ndarray) -> list[float]:
    """Least squares of times against the feature columns, every coefficient >= 0: a column the
    fit makes negative is dropped (its coefficient 0) and the rest refitted."""
    keep = list(range(features.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(features[:, keep], times, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep = [k for k, c in zip(keep, coef, strict=True) if c >= 0]
    full = [0.0] * features.shape[1]
    for k, c in zip(keep, coef, strict=True):
        full[k] = max(float(c), 0.0)
    return full
