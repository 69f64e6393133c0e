"""The scheduler's output: one micro-batch, the record a StepPlan carries to every stage."""

from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from controller.scheduler.sequence import SamplingParams

if TYPE_CHECKING:
    import numpy.typing as npt


class TokenHistory(NamedTuple):
    """A sequence's tokens so far and its stop tokens, for the last stage's penalties and
    min_tokens (sent once, with the sequence's first chunk, only for requests that use them)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: frozenset[int]


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
    """The chunk's token ids (stage 0 embeds them); empty for a decode that goes ahead."""
    sampling: SamplingParams | None
    """Set on the first chunk the workers see of this sequence (also after a preemption)."""
    history: TokenHistory | None = None
    """With `sampling`, for a request whose logits the last stage adjusts (penalties, a grammar):
    the tokens it counts from."""
    ahead: bool = False
    """A decode scheduled while the sequence's previous decode was in flight (decode_ahead):
    its input is the token that decode samples, which only the worker knows."""

    @property
    def context_len(self) -> int:
        """Tokens the chunk attends to, itself included."""
        return self.first_position + self.num_tokens


class DecodeBlock(NamedTuple):
    """A micro-batch's decodes from the decode roster, as columns: each is one token at
    `positions[i]` that yields the next one, with no sampling params (the workers know the
    sequence already)."""

    slots: npt.NDArray[np.int64]
    """Roster slots, so the result is applied with vector operations."""
    roster_leaves: int
    """The roster's num_leaves when the block was built: unchanged, every slot is as it was."""
    seq_ids: list[int]
    positions: npt.NDArray[np.int64]
    seqs: npt.NDArray[np.object_]
    """The Sequence objects, in the same order."""
    new_block_at: list[int]
    """Indices (into the columns) of the decodes that cross into a new KV block, ascending."""
    new_block_ids: list[int]
    """The block each of those appends, in the same order."""
    tokens: list[int]
    """Each decode's input token (its sequence's last one when the block was built); 0 where
    the decode goes ahead."""
    ahead_at: list[int]
    """Indices (into the columns) of the decodes that go ahead (ScheduledChunk.ahead),
    ascending."""


class MicroBatch:
    """One micro-batch. Decodes of roster sequences are held as columns (a DecodeBlock placed
    before chunk `decodes_at` of `other_chunks`); `chunks` builds the per-sequence records on
    first use, for the wire encoder, the cost model and tests."""

    __slots__ = (
        "_all",
        "_chunks",
        "batch_id",
        "block_copies",
        "decodes",
        "decodes_at",
        "finished_seq_ids",
        "num_cached_tokens",
        "num_tokens",
    )
    __match_args__ = ("batch_id", "chunks", "finished_seq_ids", "num_tokens")

    def __init__(
        self,
        batch_id: int,
        chunks: list[ScheduledChunk],
        finished_seq_ids: list[int],
        num_tokens: int,
        decodes: DecodeBlock | None = None,
        decodes_at: int = 0,
        block_copies: list[tuple[int, int]] | None = None,
    ) -> None:
        self.batch_id = batch_id
        self.finished_seq_ids = finished_seq_ids
        """Sequences finished, aborted or preempted since the previous micro-batch: workers drop
        their state before running this one."""
        self.num_tokens = num_tokens
        self.decodes = decodes
        self.decodes_at = decodes_at
        self.block_copies = block_copies or []
        """KV blocks (from, to) every stage copies before this micro-batch's forward pass: the
        partial prompt block of each sequence forked since the previous one (n > 1)."""
        self._chunks = chunks
        self._all: list[ScheduledChunk] | None = None
        self.num_cached_tokens = 0
        """Tokens the sequences the workers meet in this micro-batch took from the prefix cache
        (or a forking leader) instead of computing them."""

    @property
    def other_chunks(self) -> list[ScheduledChunk]:
        """The chunks not in the decode block (prefill chunks, and decodes built one by one)."""
        return self._chunks

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """Every chunk in micro-batch order."""
        block = self.decodes
        if block is None:
            return self._chunks
        if self._all is not None:
            return self._all
        # Built with C-level maps, not a Python loop (tests and tools read them; the wire and
        # the simulator read the columns).
        num = len(block.seq_ids)
        new_block_ids: list[tuple[int, ...]] = [()] * num
        for i, block_id in zip(block.new_block_at, block.new_block_ids, strict=True):
            new_block_ids[i] = (block_id,)
        token_ids: list[list[int]] = list(map(list, zip(block.tokens)))  # [token]
        ahead = [False] * num
        for i in block.ahead_at:
            token_ids[i], ahead[i] = [], True
        fields = zip(
            block.seq_ids,
            block.positions.tolist(),
            repeat(1),
            repeat(True),
            new_block_ids,
            token_ids,
            repeat(None),  # sampling
            repeat(None),  # history
            ahead,
        )
        decodes = list(map(tuple.__new__, repeat(ScheduledChunk), fields))
        at = self.decodes_at
        self._all = self._chunks[:at] + decodes + self._chunks[at:]
        return self._all

    @property
    def num_chunks(self) -> int:
        block = self.decodes
        return len(self._chunks) + (0 if block is None else len(block.seq_ids))

    def yielding_seq_ids(self) -> list[int]:
        """Ids of the sequences that get a token from this micro-batch, in micro-batch order:
        the keys of the map `Scheduler.on_result` takes."""
        block = self.decodes
        if block is None:
            return [c.seq_id for c in self._chunks if c.yields_token]
        at = self.decodes_at
        return (
            [c.seq_id for c in self._chunks[:at] if c.yields_token]
            + block.seq_ids
            + [c.seq_id for c in self._chunks[at:] if c.yields_token]
        )

    def __repr__(self) -> str:
        return (
            f"MicroBatch(id={self.batch_id}, chunks={self.num_chunks}, tokens={self.num_tokens}, "
            f"finished={self.finished_seq_ids})"
        )
