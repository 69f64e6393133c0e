"""A micro-batch's predicted stage time, for a budget in time rather than in tokens.

Linear in the micro-batch's work: fixed_s + per_token_s * tokens + per_attended_s * attended,
where `attended` counts (query token, key position) pairs. A decode over a context of c tokens
attends c keys; a prompt chunk of n tokens starting at position p attends n * p + n (n + 1) / 2.
So a decode over 3,000 tokens costs more than one over 100, and the late chunks of a long prompt
more than its first chunk, as they do on the hardware. The coefficients come from the stage's
cost profile (a fit of the simulator's cost model, or of `sarathictl bench stage` on a stage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controller.scheduler.errors import ConfigError

if TYPE_CHECKING:
    from controller.scheduler.batch import MicroBatch


def attended(first_position: int, num_tokens: int) -> int:
    """(query, key) pairs of a chunk of num_tokens from first_position (causal)."""
    return num_tokens * first_position + num_tokens * (num_tokens + 1) // 2


def micro_batch_features(batch: MicroBatch) -> tuple[int, int, int, int]:
    """(prompt tokens, decodes, prefill pairs, decode keys) of a micro-batch: what a profile's
    coefficients weigh."""
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
    return prompt_tokens, decodes, prefill_pairs, decode_keys


@dataclass(frozen=True)
class StepCostModel:
    fixed_s: float = 0.0
    """Seconds every micro-batch costs whatever it carries."""
    per_token_s: float = 1e-4
    """Seconds per token (the linear layers)."""
    per_attended_s: float = 0.0
    """Seconds per (query token, key position) pair (attention over the KV cache)."""

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_token_s", "per_attended_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(name, value, "a finite number of seconds >= 0")
        if self.per_token_s == 0 and self.per_attended_s == 0:
            raise ConfigError("per_token_s", self.per_token_s, "> 0 (or per_attended_s > 0)")

    def chunk_s(self, first_position: int, num_tokens: int) -> float:
        return self.per_token_s * num_tokens + self.per_attended_s * attended(
            first_position, num_tokens
        )

    def decodes_s(self, num_decodes: int, attended_total: int) -> float:
        """num_decodes decodes whose contexts add up to attended_total."""
        return self.per_token_s * num_decodes + self.per_attended_s * attended_total

    def largest_chunk(self, first_position: int, time_left_s: float, limit: int) -> int:
        """The most tokens (at most limit) a chunk from first_position fits into time_left_s."""
        if time_left_s <= 0 or limit <= 0:
            return 0
        # per_attended / 2 * n^2 + (per_token + per_attended * (p + 1/2)) * n <= time_left
        a = self.per_attended_s / 2
        b = self.per_token_s + self.per_attended_s * (first_position + 0.5)
        if a == 0:
            n = int(time_left_s / b)
        else:
            n = int((-b + math.sqrt(b * b + 4 * a * time_left_s)) / (2 * a))
        n = min(limit, n)
        # The root is rounded either way: step to the largest n that fits by chunk_s itself.
        while n > 0 and self.chunk_s(first_position, n) > time_left_s:
            n -= 1
        while n < limit and self.chunk_s(first_position, n + 1) <= time_left_s:
            n += 1
        return n
