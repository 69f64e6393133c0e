"""The scheduler: a pure, deterministic state machine over sequences, KV blocks and micro-batches.

No clock, no I/O: `now` is an argument. The engine (or the simulator) calls `add_request`,
`schedule` whenever a pipeline slot is free, and `on_result` when a micro-batch's sampled tokens
come back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from controller.scheduler.batch import MicroBatch
from controller.scheduler.batch_builder import BatchBuilder
from controller.scheduler.block_manager import BlockManager
from controller.scheduler.config import CacheConfig, SchedulerConfig
from controller.scheduler.errors import InvalidRequestError
from controller.scheduler.policies import make_policy
from controller.scheduler.sequence import FinishReason, RequestParams, Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig) -> None:
        self.config = config
        self.cache = cache
        self.policy = make_policy(config.policy)
        self.block_manager = BlockManager(
            cache.num_blocks, cache.block_size, cache.watermark_blocks
        )
        self.waiting: deque[Sequence] = deque()
        # Admitted sequences (holding KV blocks), in admission order.
        self.running: dict[int, Sequence] = {}
        self._live: dict[int, Sequence] = {}
        self._inflight: dict[int, MicroBatch] = {}
        self._finished_since_last_batch: list[int] = []
        self._next_batch_id = 1
        self.num_preemptions = 0

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self, seq_id: int, prompt_token_ids: list[int], params: RequestParams, now: float
    ) -> Sequence:
        """Queues a request; raises InvalidRequestError (nothing queued) if it can never be served.
        seq_id must never be reused, even after the sequence finished."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "is empty")
        if params.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {params.max_tokens}")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.config.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is {total}, beyond the model's context of {self.config.max_model_len} tokens",
            )
        bm = self.block_manager
        if bm.blocks_for(total) > bm.num_blocks - bm.watermark_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"{total} tokens need {bm.blocks_for(total)} KV blocks; the cache holds "
                f"{bm.num_blocks - bm.watermark_blocks} for one sequence",
            )
        if seq_id in self._live:
            raise InvalidRequestError("request_id", f"sequence {seq_id} is already running")
        seq = Sequence(seq_id, prompt_token_ids, params, now)
        self.waiting.append(seq)
        self._live[seq_id] = seq
        return seq

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """Ends a sequence in any state (also used for stop strings, which the engine detects).
        Its work already in flight completes on the workers and is ignored; they drop its state
        at the next micro-batch. Returns None if no live sequence has that id."""
        seq = self._live.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return seq

    # ---- steps ----------------------------------------------------------------------------
    def schedule(self, now: float) -> MicroBatch | None:
        """The next micro-batch, or None when the pipeline is full or nothing can run now."""
        if len(self._inflight) >= self.config.pipeline_depth:
            return None
        builder = BatchBuilder(self, now)
        self.policy.build(builder)
        if not builder.chunks:
            return None
        batch = MicroBatch(
            self._next_batch_id, builder.chunks, self._finished_since_last_batch, builder.num_tokens
        )
        self._finished_since_last_batch = []
        self._next_batch_id += 1
        self._inflight[batch.batch_id] = batch
        return batch

    def on_result(self, batch_id: int, sampled: Mapping[int, int], now: float) -> list[Sequence]:
        """Applies a finished micro-batch: sampled maps seq_id to its new token for every chunk
        that yields one. Returns the sequences that received a token (finished ones included,
        with finish_reason set), in micro-batch order."""
        batch = self._inflight.pop(batch_id, None)
        if batch is None:
            raise ValueError(f"micro-batch {batch_id} is not in flight")
        live = self._live
        updated: list[Sequence] = []
        for chunk in batch.chunks:
            seq = live.get(chunk.seq_id)
            if seq is None:
                continue  # finished or aborted while this micro-batch was in flight
            seq.num_inflight_batches -= 1
            if not chunk.yields_token:
                continue
            token_id = sampled.get(chunk.seq_id)
            if token_id is None:
                raise ValueError(
                    f"micro-batch {batch_id} returned no token for sequence {chunk.seq_id}"
                )
            seq.output_token_ids.append(token_id)
            seq.num_tokens += 1  # Sequence.append_token, inlined on this hot path
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            if len(seq.output_token_ids) >= seq.max_tokens:
                self._finish(seq, FinishReason.LENGTH)
            elif token_id in seq.stop_token_ids:
                self._finish(seq, FinishReason.STOP)
            updated.append(seq)
        return updated

    def reset_inflight(self) -> list[Sequence]:
        """The pipeline was rebuilt: every micro-batch in flight is lost and the new workers hold
        no sequence state. Every admitted sequence goes back to the queue to be recomputed from
        its prompt plus the tokens it already produced (nothing sampled is lost or repeated).
        Returns the sequences sent back, oldest arrival first."""
        self._inflight.clear()
        self._finished_since_last_batch = []
        requeued = sorted(self.running.values(), key=lambda s: (s.arrival_time, s.seq_id))
        for seq in reversed(requeued):  # appendleft: the oldest ends up first in the queue
            seq.num_inflight_batches = 0
            self._preempt(seq)
        for seq in self.waiting:
            seq.needs_worker_state = True
        # Preempted ids were queued for the old workers; the new ones never saw them.
        self._finished_since_last_batch = []
        return requeued

    @property
    def num_waiting_prompt_tokens(self) -> int:
        """Tokens the queued sequences will prefill (prompt plus output kept for recompute)."""
        return sum(seq.num_tokens for seq in self.waiting)

    def take_finished_seq_ids(self) -> list[int]:
        """Sequences the workers may forget, for an engine that flushes them while idle."""
        ids, self._finished_since_last_batch = self._finished_since_last_batch, []
        return ids

    # ---- KV memory ------------------------------------------------------------------------
    def grow_by_one_block(self, seq: Sequence) -> int | None:
        """A new KV block for seq, preempting the latest arrivals that have nothing in flight
        until one is free. None if seq itself was preempted or every candidate is in flight."""
        bm = self.block_manager
        while bm.num_free == 0:
            victim = self._pick_victim()
            if victim is None:
                return None
            self._preempt(victim)
            if victim is seq:
                return None
        block_id = bm.allocate_one()
        seq.block_ids.append(block_id)
        return block_id

    def _pick_victim(self) -> Sequence | None:
        candidates = [s for s in self.running.values() if s.num_inflight_batches == 0]
        if not candidates:
            return None
        return max(candidates, key=lambda s: (s.arrival_time, s.seq_id))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free its blocks, forget its progress, put it first in the queue."""
        self.block_manager.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.needs_worker_state = True
        seq.num_preemptions += 1
        del self.running[seq.seq_id]
        self.waiting.appendleft(seq)
        self._finished_since_last_batch.append(seq.seq_id)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq.block_ids)
        seq.block_ids = []
        self.running.pop(seq.seq_id, None)
        del self._live[seq.seq_id]
        self._finished_since_last_batch.append(seq.seq_id)

    # ---- views ----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_inflight_batches(self) -> int:
        return len(self._inflight)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def kv_usage(self) -> float:
        return self.block_manager.usage

    def get(self, seq_id: int) -> Sequence | None:
        return self._live.get(seq_id)

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (for tests and debugging)."""
        bs = self.block_manager.block_size
        for seq in self.running.values():
            assert seq.status is SequenceStatus.RUNNING, seq
            assert len(seq.block_ids) * bs >= seq.num_computed_tokens, f"{seq} lacks KV blocks"
            assert seq.num_computed_tokens <= seq.num_tokens, seq
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_ids, seq
            assert seq.num_computed_tokens == 0, seq
        assert len(self.running) + len(self.waiting) == len(self._live)
        assert len(self._inflight) <= self.config.pipeline_depth
        self.block_manager.check_invariants(s.block_ids for s in self.running.values())
