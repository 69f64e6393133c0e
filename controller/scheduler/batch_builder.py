"""Building one micro-batch: the moves a policy may make, with the KV accounting they imply.

A policy decides the order and the mix (decodes, ongoing prefills, new requests); this class does
the bookkeeping every policy shares: readiness in a pipeline, block allocation, preemption by
recompute, and the token budget.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from controller.scheduler.batch import DecodeBlock, ScheduledChunk
from controller.scheduler.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from controller.scheduler.scheduler import Scheduler


# ScheduledChunk's generated __new__ is a Python function; tuple.__new__ builds the same record
# in C, for the per-decode records.
_new_chunk = tuple.__new__


class BatchBuilder:
    def __init__(self, scheduler: Scheduler, now: float) -> None:
        self._sched = scheduler
        self._now = now
        self.chunks: list[ScheduledChunk] = []
        """Every chunk but the decodes that go as a vector block, in `decodes`."""
        self.decodes: DecodeBlock | None = None
        self.decodes_at = 0
        """Index in `chunks` the decode block goes before."""
        self._decodes_added = False
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
        token is back, in admission order; capped: stop at the token budget. Preempts (latest
        arrival first) when a decode needs a new KV block and none is free. Returns the number
        added.

        This runs for every decoding sequence on every step. Many decodes go as one vector
        block over the decode roster's columns (a few numpy operations, whatever their number);
        a few go as per-sequence chunks, because each numpy call costs a microsecond or so and a
        dozen of them outweigh a short Python loop (scheduler.vector_decodes_from draws the
        line)."""
        assert not self._decodes_added, "add_decodes called twice for one micro-batch"
        self._decodes_added = True
        sched = self._sched
        roster = sched.roster
        if not roster.size:
            return 0
        order = roster.order()
        if roster.size < sched.vector_decodes_from:
            limit = self.budget_tokens - self.num_tokens if capped else roster.size
            return self._add_decodes_as_chunks(order, limit)
        computed = roster.computed[order]
        ready = computed < roster.num_tokens[order]  # else its last token is still in flight
        if not sched.config.pipeline_prefill_chunks:
            ready &= roster.inflight[order] == 0
        # ndarray.nonzero, not np.flatnonzero: the same on 1-d arrays, without its wrappers'
        # cost (a few microseconds, on every step).
        if np.count_nonzero(ready) == len(ready):  # the usual case with one batch in flight
            slots, positions = order, computed
        else:
            picked = ready.nonzero()[0]
            slots, positions = order[picked], computed[picked]
        limit = self.budget_tokens - self.num_tokens if capped else len(slots)
        if limit < len(slots):
            limit = max(limit, 0)
            slots, positions = slots[:limit], positions[:limit]
        if not len(slots):
            return 0
        crossing = (positions >= roster.kv_capacity[slots]).nonzero()[0]
        bm = sched.block_manager
        if len(crossing) > bm.num_free:
            # Some decode would preempt: the exact one-by-one walk decides who.
            return self._add_decodes_as_chunks(order, limit)
        new_block_ids: list[int] = []
        if len(crossing):
            new_block_ids = bm.allocate(len(crossing))
            growing = slots[crossing]
            deque(map(list.append, roster.block_lists[growing], new_block_ids), 0)
            roster.kv_capacity[growing] += bm.block_size
        roster.computed[slots] = positions + 1
        roster.inflight[slots] += 1
        self.decodes = DecodeBlock(
            slots,
            roster.num_leaves,
            roster.id_objs[slots].tolist(),
            positions,
            roster.seqs[slots],
            crossing.tolist(),
            new_block_ids,
        )
        self.decodes_at = len(self.chunks)
        self.num_tokens += len(slots)
        return len(slots)

    def _add_decodes_as_chunks(self, order: npt.NDArray[np.int64], limit: int) -> int:
        """add_decodes one sequence at a time, each decode a chunk of its own: for a few
        decodes, and when KV blocks may run out (each decode grows, and so perhaps preempts,
        before the next one is looked at)."""
        sched = self._sched
        roster = sched.roster
        wait_for_batch = not sched.config.pipeline_prefill_chunks
        # The array.array twins of the columns: one slot at a time, Python ints are cheaper.
        computed, num_tokens = roster.py_computed, roster.py_num_tokens
        inflight, kv_capacity = roster.py_inflight, roster.py_kv_capacity
        append = self.chunks.append
        added = 0
        for seq in roster.seqs[order].tolist():
            if seq._roster is None:
                continue  # preempted by an earlier decode of this loop
            slot = seq._slot
            position = computed[slot]
            if num_tokens[slot] - position != 1:
                continue  # its last token is still in flight
            if wait_for_batch and inflight[slot]:
                continue
            if added >= limit:
                break
            new_block_ids: tuple[int, ...] = ()
            if position >= kv_capacity[slot]:
                block_id = sched.grow_by_one_block(seq)
                if block_id is None:
                    continue  # preempted itself, or must wait for an in-flight batch to return
                new_block_ids = (block_id,)
            computed[slot] = position + 1
            inflight[slot] += 1
            # No sampling params: the workers know a decoding sequence already.
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
                        None,
                    ),
                )
            )
            added += 1
        self.num_tokens += added
        return added

    def add_partial_prefills(self) -> int:
        """Adds the next chunk of every admitted prompt not fully computed, within the budget."""
        sched = self._sched
        wait_for_batch = not sched.config.pipeline_prefill_chunks
        added = 0
        # A decoding sequence never has a prefill chunk, so only the others are looked at; a
        # snapshot because a chunk that leaves one token to compute moves its sequence to the
        # decode roster.
        for seq in tuple(sched.not_decoding.values()):
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
            sched.admit(seq)
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
        if end == seq.num_tokens - 1 and seq.output_token_ids:
            self._sched.join_roster(seq)  # a recompute that stops one token short: it decodes
