"""A measured cost model: stage times a real deployment's profiler wrote, interpolated.

CSV columns: num_tokens (tokens in the micro-batch), context_tokens (sum over its chunks of the
tokens each attends to), stage_time_s (one stage's time for it). Rows on a grid of context levels
work best; between levels the time is interpolated linearly, beyond the last num_tokens it is
extrapolated along the last segment (compute-bound batches grow linearly).
"""

from __future__ import annotations

import bisect
import csv
from pathlib import Path

from controller.scheduler import MicroBatch
from controller.simulator.cost_model import StageCost

PROFILE_COLUMNS = ("num_tokens", "context_tokens", "stage_time_s")


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)  # extrapolate from the first or the last segment
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class MeasuredProfile:
    """Every stage is taken to cost the same (the profile is of one stage); transfers are given."""

    def __init__(
        self,
        rows: list[tuple[int, int, float]],
        num_stages: int = 1,
        transfer_s: float = 0.0,
    ) -> None:
        if not rows:
            raise ValueError("the profile has no rows")
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        self.num_stages = num_stages
        self.transfer_s = transfer_s
        levels: dict[int, list[tuple[int, float]]] = {}
        for num_tokens, context_tokens, time_s in rows:
            levels.setdefault(context_tokens, []).append((num_tokens, time_s))
        self._contexts = sorted(levels)
        self._curves: list[tuple[list[float], list[float]]] = []
        for context in self._contexts:
            points = sorted(levels[context])
            self._curves.append(([float(n) for n, _ in points], [t for _, t in points]))

    @classmethod
    def from_csv(
        cls, path: str | Path, num_stages: int = 1, transfer_s: float = 0.0
    ) -> MeasuredProfile:
        """Reads a profile; a missing column or a negative value names the line."""
        rows: list[tuple[int, int, float]] = []
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in PROFILE_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{path}: line 1: missing column(s) {', '.join(missing)}")
            for line_no, row in enumerate(reader, start=2):
                try:
                    num_tokens = int(row["num_tokens"])
                    context = int(row["context_tokens"])
                    time_s = float(row["stage_time_s"])
                except (TypeError, ValueError):
                    raise ValueError(f"{path}: line {line_no}: not a number: {row}") from None
                if num_tokens < 1 or context < 0 or not time_s > 0:
                    raise ValueError(
                        f"{path}: line {line_no}: num_tokens must be >= 1, context_tokens >= 0 "
                        f"and stage_time_s > 0, got {num_tokens}, {context}, {time_s}"
                    )
                rows.append((num_tokens, context, time_s))
        return cls(rows, num_stages, transfer_s)

    def stage_time_s(self, num_tokens: int, context_tokens: int) -> float:
        contexts = self._contexts
        at_level = [_interpolate(xs, ys, num_tokens) for xs, ys in self._curves]
        if context_tokens <= contexts[0]:
            return at_level[0]
        if context_tokens >= contexts[-1]:
            return at_level[-1]
        return _interpolate([float(c) for c in contexts], at_level, context_tokens)

    def micro_batch_cost(self, batch: MicroBatch) -> StageCost:
        context = 0
        for chunk in batch.chunks:
            context += chunk.first_position + chunk.num_tokens
        time_s = self.stage_time_s(batch.num_tokens, context)
        return StageCost([time_s] * self.num_stages, self.transfer_s)
