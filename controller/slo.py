"""SLO mode: the token budget, the time budget and the cap on running sequences that keep the
predicted P99 time between tokens under a target, from the stage's cost profile.

With PP stages and decodes spread over the PP micro-batches in flight, a decode advances once per
round of PP micro-batches, so its time between tokens is about PP stage times (one stage time at
PP = 1). Each micro-batch is therefore held to `headroom * tbt_slo / PP` of predicted stage time:
the token budget is the largest multiple of the tile whose prompt chunk fits (at the context a
late chunk typically sits), the same time becomes the scheduler's time budget (so long-context
work shrinks the chunk), and the running sequences are capped so that a round's decodes, over
contexts of max_context tokens, fit that time too. Headroom leaves room for the controller's
step, transfers and noise between the mean and the P99.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.scheduler import ConfigError
from controller.scheduler.step_cost import StepCostModel

MAX_BUDGET_TOKENS = 16384
DEFAULT_HEADROOM = 0.8


@dataclass(frozen=True)
class SloChoice:
    tbt_slo_s: float
    stage_time_s: float
    """Predicted time each micro-batch may take on a stage: the time budget."""
    budget_tokens: int
    max_num_seqs: int
    predicted_tbt_s: float
    """PP times the predicted time of a full micro-batch (a budget's prompt chunk)."""

    def describe(self) -> str:
        return (
            f"--tbt-slo {self.tbt_slo_s:g} s: budget {self.budget_tokens} tokens, at most "
            f"{self.max_num_seqs} running, {self.stage_time_s * 1e3:.1f} ms per micro-batch per "
            f"stage (predicted TBT {self.predicted_tbt_s * 1e3:.0f} ms)"
        )


def choose_for_tbt_slo(
    tbt_slo_s: float,
    cost: StepCostModel,
    pipeline_depth: int,
    tile_tokens: int,
    context_tokens: int,
    headroom: float = DEFAULT_HEADROOM,
) -> SloChoice:
    """context_tokens: where the chunks and the decodes sit (typical of the workload; the
    model's context length is the safe choice)."""
    if not tbt_slo_s > 0:
        raise ConfigError("tbt_slo", tbt_slo_s, "seconds > 0")
    if not 0 < headroom <= 1:
        raise ConfigError("slo_headroom", headroom, "in (0, 1]")
    stage_time_s = headroom * tbt_slo_s / pipeline_depth
    room_s = stage_time_s - cost.fixed_s
    budget = cost.largest_chunk(context_tokens, room_s, MAX_BUDGET_TOKENS)
    budget -= budget % tile_tokens
    if budget < tile_tokens:
        one_tile_s = cost.fixed_s + cost.chunk_s(context_tokens, tile_tokens)
        raise ConfigError(
            "tbt_slo",
            tbt_slo_s,
            f"more than {pipeline_depth} x {one_tile_s / headroom:.4g} s: one tile of "
            f"{tile_tokens} tokens at {context_tokens} tokens of context takes "
            f"{one_tile_s:.4g} s a stage",
        )
    decode_s = cost.decodes_s(1, context_tokens)
    per_micro_batch = int(room_s / decode_s)
    max_num_seqs = max(1, min(budget, per_micro_batch * pipeline_depth))
    predicted = pipeline_depth * (cost.fixed_s + cost.chunk_s(context_tokens, budget))
    return SloChoice(tbt_slo_s, stage_time_s, budget, max_num_seqs, predicted)


def parse_step_cost(text: str) -> StepCostModel:
    """FIXED_S,PER_TOKEN_S,PER_ATTENDED_S (as `sarathictl bench stage` prints it)."""
    parts = text.split(",")
    if len(parts) != 3:
        raise ConfigError("step_cost", text, "FIXED_S,PER_TOKEN_S,PER_ATTENDED_S")
    try:
        fixed, per_token, per_attended = (float(p) for p in parts)
    except ValueError:
        raise ConfigError("step_cost", text, "three numbers of seconds") from None
    return StepCostModel(fixed, per_token, per_attended)
