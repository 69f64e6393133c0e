"""Building one micro-batch: the moves a policy may make, with the KV accounting they imply.

A policy decides the order and the mix (decodes, ongoing prefills, new requests); this class does
the bookkeeping every policy shares: readiness in a pipeline, block allocation, preemption by
recompute, and the token budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.scheduler.batch import ScheduledChunk
from controller.scheduler.sequence import Sequence, SequenceStatus

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
        decode needs a new KV block and none is free. Returns the number added."""
        sched = self._sched
        block_size = sched.block_manager.block_size
        wait_for_batch = not sched.config.pipeline_prefill_chunks
        added = 0
        for seq in list(sched.running.values()):
            num_computed = seq.num_computed_tokens
            num_output = len(seq.output_token_ids)
            # Decode-ready: exactly one uncomputed token (the last sampled one).
            if (
                num_output == 0
                or len(seq.prompt_token_ids) + num_output - num_computed != 1
                or seq.status is not SequenceStatus.RUNNING
                or (wait_for_batch and seq.num_inflight_batches)
            ):
                continue
            if capped and self.num_tokens >= self.budget_tokens:
                break
            new_block_ids: tuple[int, ...] = ()
            if num_computed >= len(seq.block_ids) * block_size:
                block_id = sched.grow_by_one_block(seq)
                if block_id is None:
                    continue  # preempted itself, or must wait for an in-flight batch to return
                new_block_ids = (block_id,)
            self._add(seq, 1, new_block_ids)
            added += 1
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
