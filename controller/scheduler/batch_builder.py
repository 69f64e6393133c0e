"""Building one micro-batch: the moves a policy may make, with the KV accounting they imply.

A policy decides the order and the mix (decodes, ongoing prefills, new requests); this class does
the bookkeeping every policy shares: readiness in a pipeline, block allocation, preemption by
recompute, and the token budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.scheduler.batch import ScheduledChunk
from controller.scheduler.sequence import Sequence, SequenceStatus

# Builds a ScheduledChunk from one tuple without NamedTuple's Python-level __new__ (hot path).
_new_chunk = tuple.__new__

if TYPE_CHECKING:
    from controller.scheduler.scheduler import Scheduler


class BatchBuilder:
    def __init__(self, scheduler: Scheduler, now: float) -> None:
        self._sched = scheduler
        self._now = now
        self.chunks: list[ScheduledChunk] = []
        self.num_tokens = 0
        self.budget_tokens = scheduler.config.budget_tokens

    @property
    def budget_left(self) -> int:
        return self.budget_tokens - self.num_tokens

    @property
    def num_running(self) -> int:
        return len(self._sched.running)

    def add_decodes(self, capped: bool) -> int:
        """Adds one token for every running sequence whose next work is a decode and whose last
        token is back; capped: stop at the token budget. Preempts (latest arrival first) when a
        decode needs a new KV block and none is free. Returns the number added.

        This loop runs for every decoding sequence on every step, so it is written flat."""
        sched = self._sched
        block_size = sched.block_manager.block_size
        wait_for_batch = not sched.config.pipeline_prefill_chunks
        limit = self.budget_tokens if capped else 1 << 62
        num_tokens = self.num_tokens
        append = self.chunks.append
        added = 0
        # A snapshot: preemption removes sequences from `running` while we iterate. A preempted
        # one has num_computed_tokens 0 and at least 2 tokens, so the first test skips it.
        for seq in tuple(sched.running.values()):
            position = seq.num_computed_tokens
            if seq.num_tokens - position != 1 or not seq.output_token_ids:
                continue  # prefilling, or its last token is still in the pipeline
            if wait_for_batch and seq.num_inflight_batches:
                continue
            if num_tokens >= limit:
                break
            new_block_ids: tuple[int, ...] = ()
            if position >= len(seq.block_ids) * block_size:
                block_id = sched.grow_by_one_block(seq)
                if block_id is None:
                    continue  # preempted itself, or must wait for an in-flight batch to return
                new_block_ids = (block_id,)
            append(
                _new_chunk(
                    ScheduledChunk,
                    (
                        seq.seq_id,
                        position,
                        1,
                        True,
                        new_block_ids,
                        [seq.output_token_ids[-1]],
                        None,  # a decode never starts a sequence on the workers
                    ),
                )
            )
            seq.num_computed_tokens = position + 1
            seq.num_inflight_batches += 1
            num_tokens += 1
            added += 1
        self.num_tokens = num_tokens
        return added

    def add_partial_prefills(self) -> int:
        """Adds the next chunk of every admitted prompt not fully computed, within the budget."""
        sched = self._sched
        wait_for_batch = not sched.config.pipeline_prefill_chunks
        added = 0
        for seq in sched.running.values():
            if self.num_tokens >= self.budget_tokens:
                break
            remaining = seq.num_uncomputed_tokens
            if remaining == 0 or seq.is_decoding or (wait_for_batch and seq.num_inflight_batches):
                continue
            chunk = min(
                remaining,
                sched.config.max_chunk_tokens(seq.num_computed_tokens),
                self.budget_left,
            )
            self._add(seq, chunk, ())
            added += 1
        return added

    def admit_new(self, chunked: bool) -> int:
        """Admits waiting sequences in arrival order (preempted ones first) while KV blocks, the
        sequence limit and the budget allow. chunked: the first chunk takes at most the budget
        left; otherwise whole prompts, the first of a batch even past the budget (it runs alone).
        Returns the number admitted."""
        sched = self._sched
        bm = sched.block_manager
        admitted = 0
        prefill_tokens = 0
        while sched.waiting and len(sched.running) < sched.config.max_num_seqs:
            seq = sched.waiting[0]
            remaining = seq.num_tokens  # nothing is computed for a waiting sequence
            if chunked:
                chunk = min(remaining, sched.config.max_chunk_tokens(0), self.budget_left)
                if chunk <= 0:
                    break
            else:
                chunk = remaining
                if prefill_tokens and prefill_tokens + chunk > self.budget_tokens:
                    break
            num_blocks = bm.blocks_for(remaining)
            if not bm.can_admit(num_blocks):
                break
            sched.waiting.popleft()
            seq.block_ids = bm.allocate(num_blocks)
            seq.status = SequenceStatus.RUNNING
            sched.running[seq.seq_id] = seq
            self._add(seq, chunk, tuple(seq.block_ids))
            prefill_tokens += chunk
            admitted += 1
        return admitted

    def _add(self, seq: Sequence, num_tokens: int, new_block_ids: tuple[int, ...]) -> None:
        start = seq.num_computed_tokens
        end = start + num_tokens
        sampling = None
        if seq.needs_worker_state:
            sampling = seq.params.sampling
            seq.needs_worker_state = False
        self.chunks.append(
            ScheduledChunk(
                seq.seq_id,
                start,
                num_tokens,
                end == seq.num_tokens,
                new_block_ids,
                seq.token_slice(start, end),
                sampling,
            )
        )
        seq.num_computed_tokens = end
        seq.num_inflight_batches += 1
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self._now
        self.num_tokens += num_tokens
