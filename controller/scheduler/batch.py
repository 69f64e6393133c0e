"""The scheduler's output: one micro-batch, the record a StepPlan carries to every stage."""

from __future__ import annotations

from typing import NamedTuple

from controller.scheduler.sequence import SamplingParams


class ScheduledChunk(NamedTuple):
    """One sequence's share of a micro-batch: a prefill chunk, or one decode token."""

    seq_id: int
    first_position: int
    """Position of the chunk's first token in the sequence (0-based)."""
    num_tokens: int
    yields_token: bool
    """The chunk ends at the sequence's last known token, so the last stage samples one."""
    new_block_ids: tuple[int, ...]
    """KV blocks appended to the sequence's block table for this step, in order."""
    token_ids: list[int]
    """The chunk's token ids (stage 0 embeds them)."""
    sampling: SamplingParams | None
    """Set on the first chunk the workers see of this sequence (also after a preemption)."""

    @property
    def context_len(self) -> int:
        """Tokens the chunk attends to, itself included."""
        return self.first_position + self.num_tokens


class MicroBatch(NamedTuple):
    batch_id: int
    chunks: list[ScheduledChunk]
    finished_seq_ids: list[int]
    """Sequences finished, aborted or preempted since the previous micro-batch: workers drop
    their state before running this one."""
    num_tokens: int
