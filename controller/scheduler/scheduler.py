"""The scheduler: a pure, deterministic state machine over sequences, KV blocks and micro-batches.

No clock, no I/O: `now` is an argument. The engine (or the simulator) calls `add_request`,
`schedule` whenever a pipeline slot is free, and `on_result` when a micro-batch's sampled tokens
come back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from operator import itemgetter

import numpy as np
import numpy.typing as npt

from controller.scheduler.batch import DecodeBlock, MicroBatch, ScheduledChunk
from controller.scheduler.batch_builder import BatchBuilder
from controller.scheduler.block_manager import BlockManager
from controller.scheduler.config import CacheConfig, SchedulerConfig
from controller.scheduler.decode_roster import DecodeRoster
from controller.scheduler.errors import InvalidRequestError
from controller.scheduler.policies import make_policy
from controller.scheduler.prefix_cache import PrefixCache
from controller.scheduler.quarantine import Quarantine
from controller.scheduler.sequence import FinishReason, RequestParams, Sequence, SequenceStatus

# Decodes from this many decoding sequences up go to a micro-batch as one vector block (see
# BatchBuilder.add_decodes); fewer go as one chunk each. Measured on one core: a step with 16
# decoding sequences costs about the same either way.
VECTOR_DECODES_FROM = 16


def stop_hits(
    tokens: npt.NDArray[np.int64], stop_ids: npt.NDArray[np.int64]
) -> npt.NDArray[np.intp]:
    """Positions of tokens ([n]) that are any of stop_ids ([k]). A few stop ids (EOS and its
    kin, the usual case) are compared one by one: several times faster than np.isin there."""
    if len(stop_ids) > 8:
        return np.isin(tokens, stop_ids).nonzero()[0]
    hit = np.zeros(len(tokens), bool)
    for stop_id in stop_ids.tolist():
        hit |= tokens == stop_id
    return hit.nonzero()[0]


def _arrival_order(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        vector_decodes_from: int = VECTOR_DECODES_FROM,
        spread_decodes: bool = True,
    ) -> None:
        """vector_decodes_from: a speed knob only, the micro-batches are the same either way
        (tests set it to exercise both paths). spread_decodes: with PP > 1, spread the decoding
        sequences over the micro-batches in flight (BatchBuilder.add_decodes); off, every ready
        decode goes into the next micro-batch, as before (a reference for tests and
        measurements; with PP = 1 the two are the same)."""
        self.config = config
        self.vector_decodes_from = vector_decodes_from
        self.spread_decodes = spread_decodes and config.pipeline_depth > 1
        self.spread_prompts = (
            config.spread_prompts and config.pipeline_depth > 1 and config.pipeline_prefill_chunks
        )
        self.cache = cache
        self.policy = make_policy(config.policy)
        self.block_manager = BlockManager(
            cache.num_blocks, cache.block_size, cache.watermark_blocks
        )
        self.prefix_cache = PrefixCache(self.block_manager, cache.prefix_salt, cache.prefix_caching)
        self.waiting: deque[Sequence] = deque()
        # Admitted sequences (holding KV blocks), in admission order: those decoding are on the
        # roster, the others (prefilling, or waiting for the token of their last chunk) in
        # not_decoding, also in admission order.
        self.running: dict[int, Sequence] = {}
        self.roster = DecodeRoster(cache.block_size)
        self.not_decoding: dict[int, Sequence] = {}
        self._next_admit_no = 0
        self._live: dict[int, Sequence] = {}
        self._inflight: dict[int, MicroBatch] = {}
        self.inflight_decodes: dict[int, int] = {}
        """Decodes in each micro-batch in flight, by batch id (kept when spread_decodes)."""
        self.inflight_prompt_tokens: dict[int, int] = {}
        """Prompt tokens in each micro-batch in flight, by batch id (kept when spread_prompts)."""
        self._finished_since_last_batch: list[int] = []
        self._next_batch_id = 1
        self.num_preemptions = 0
        self.forks: dict[int, list[Sequence]] = {}
        """A request's sequences 2..n (n > 1), held until the first one's prompt is scheduled
        whole, by the first one's seq id (see add_request_group)."""
        self._held: dict[int, int] = {}
        """Each held sequence's leader."""
        self.forking: list[Sequence] = []
        """Leaders whose prompt the micro-batch being built schedules whole (BatchBuilder)."""
        self._cached_since_last_batch = 0
        """Tokens the sequences started since the last micro-batch took from a cached prefix."""
        self._pending_copies: dict[int, tuple[int, int]] = {}
        """KV block copies (from, to) the next micro-batch makes before its forward pass, by
        the sequence they are for (see start_from); each source block has one more holder
        until that micro-batch is built, so nothing else takes it before it is copied."""
        self.quarantine = Quarantine()
        """The sequences of micro-batches that failed on a worker, and the one on trial."""

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        params: RequestParams,
        now: float,
        output_token_ids: Iterable[int] = (),
    ) -> Sequence:
        """Queues a request; raises InvalidRequestError (nothing queued) if it can never be served.
        seq_id must never be reused, even after the sequence finished. output_token_ids: a resumed
        request's tokens so far, recomputed with the prompt as after a preemption."""
        outputs = list(output_token_ids)
        self._check_request(seq_id, prompt_token_ids, params, outputs)
        seq = Sequence(seq_id, prompt_token_ids, params, now)
        seq.output_token_ids = outputs
        self.waiting.append(seq)
        self._live[seq_id] = seq
        return seq

    def add_request_group(
        self,
        seq_ids: list[int],
        prompt_token_ids: list[int],
        params: list[RequestParams],
        now: float,
    ) -> list[Sequence]:
        """n sequences of one prompt (a request with n > 1), each with its own params (its own
        seed). The first computes the prompt; the others wait, and once its prompt is scheduled
        whole they fork from it: each shares its full KV blocks, gets a copy of the partial one
        and computes only the last prompt token itself, which yields its first token. Raises
        InvalidRequestError (nothing queued) as add_request does."""
        if len(seq_ids) != len(params) or not seq_ids:
            raise ValueError(f"{len(seq_ids)} seq ids for {len(params)} params")
        for seq_id, seq_params in zip(seq_ids, params, strict=True):
            self._check_request(seq_id, prompt_token_ids, seq_params, [])
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequestError("request_id", f"sequence ids {seq_ids} repeat")
        leader = self.add_request(seq_ids[0], prompt_token_ids, params[0], now)
        followers = [
            Sequence(seq_id, prompt_token_ids, seq_params, now)
            for seq_id, seq_params in zip(seq_ids[1:], params[1:], strict=True)
        ]
        if followers:
            self.forks[leader.seq_id] = followers
        for seq in followers:
            self._live[seq.seq_id] = seq
            self._held[seq.seq_id] = leader.seq_id
        return [leader, *followers]

    def _check_request(
        self, seq_id: int, prompt_token_ids: list[int], params: RequestParams, outputs: list[int]
    ) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "is empty")
        if params.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {params.max_tokens}")
        if len(outputs) >= params.max_tokens:
            raise InvalidRequestError(
                "resume_token_ids",
                f"{len(outputs)} tokens already reach max_tokens ({params.max_tokens}): the "
                "stream had ended",
            )
        ended = next((i for i, t in enumerate(outputs) if t in params.stop_token_ids), None)
        if ended is not None:
            raise InvalidRequestError(
                "resume_token_ids",
                f"token {ended} ({outputs[ended]}) is a stop token: the stream had ended",
            )
        context = self.config.max_model_len
        if len(prompt_token_ids) + len(outputs) >= context:  # not max_tokens' fault
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt_token_ids) + len(outputs)} tokens leave no room for a generated "
                f"token in the model's context of {context} tokens",
            )
        total = len(prompt_token_ids) + params.max_tokens
        if total > context:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is {total}, beyond the model's context of {context} tokens",
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

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """Ends a sequence in any state (also used for stop strings, which the engine detects).
        Its work already in flight completes on the workers and is ignored; they drop its state
        at the next micro-batch. Returns None if no live sequence has that id."""
        seq = self._live.get(seq_id)
        if seq is None:
            return None
        leader_id = self._held.pop(seq_id, None)
        if leader_id is not None:
            self.forks[leader_id].remove(seq)
            if not self.forks[leader_id]:
                del self.forks[leader_id]
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return seq

    # ---- steps ----------------------------------------------------------------------------
    def schedule(self, now: float) -> MicroBatch | None:
        """The next micro-batch, or None when the pipeline is full or nothing can run now."""
        if len(self._inflight) >= self.config.max_inflight_batches:
            return None
        if self.quarantine.active and not self._run_trials():
            return None
        builder = BatchBuilder(self, now)
        self.policy.build(builder)
        if not builder.chunks and builder.decodes is None:
            return None
        batch = MicroBatch(
            self._next_batch_id,
            builder.chunks,
            self._finished_since_last_batch,
            builder.num_tokens,
            builder.decodes,
            builder.decodes_at,
            list(self._pending_copies.values()),
        )
        self._finished_since_last_batch = []
        batch.num_cached_tokens, self._cached_since_last_batch = self._cached_since_last_batch, 0
        if self._pending_copies:
            self._pending_copies = {}
            self.block_manager.free([src for src, _ in batch.block_copies])  # copied by then
        for seq in builder.prefilled:
            if seq.status is SequenceStatus.RUNNING:
                self.prefix_cache.register(seq)
        if self.forking:
            # After the batch: a forked sequence's first step must come after (on every stage)
            # the step that writes the KV it shares and copies.
            for leader in self.forking:
                self._fork(leader)
            self.forking = []
        self._next_batch_id += 1
        self._inflight[batch.batch_id] = batch
        if self.spread_decodes:
            self.inflight_decodes[batch.batch_id] = builder.num_decodes
        if self.spread_prompts:
            self.inflight_prompt_tokens[batch.batch_id] = builder.num_prompt_tokens
        return batch

    def on_result(self, batch_id: int, sampled: Mapping[int, int], now: float) -> list[Sequence]:
        """Applies a finished micro-batch: sampled maps seq_id to its new token for every chunk
        that yields one. Returns the sequences that received a token (finished ones included,
        with finish_reason set), in micro-batch order."""
        batch = self._inflight.pop(batch_id, None)
        if batch is None:
            raise ValueError(f"micro-batch {batch_id} is not in flight")
        if self.quarantine.on_trial is not None:
            self.quarantine.returned(batch)
        if self.spread_decodes:
            del self.inflight_decodes[batch_id]
        self.inflight_prompt_tokens.pop(batch_id, None)
        updated: list[Sequence] = []
        chunks = batch.other_chunks
        block = batch.decodes
        if block is None:
            self._apply_chunks(chunks, batch_id, sampled, now, updated)
            return updated
        at = batch.decodes_at
        before = chunks[:at]
        self._apply_chunks(before, batch_id, sampled, now, updated)
        first_token = sum(1 for c in before if c.yields_token)
        self._apply_decodes(block, batch_id, sampled, first_token, now, updated)
        self._apply_chunks(chunks[at:], batch_id, sampled, now, updated)
        return updated

    def _apply_chunks(
        self,
        chunks: list[ScheduledChunk],
        batch_id: int,
        sampled: Mapping[int, int],
        now: float,
        updated: list[Sequence],
    ) -> None:
        live = self._live
        roster = self.roster
        inflight, num_tokens = roster.py_inflight, roster.py_num_tokens
        last_token_time, last_token = roster.py_last_token_time, roster.py_last_token
        for chunk in chunks:
            seq_id = chunk.seq_id
            seq = live.get(seq_id)
            if seq is None:
                continue  # finished or aborted while this micro-batch was in flight
            if seq._roster is None or not chunk.yields_token:
                seq.num_inflight_batches -= 1
                if chunk.yields_token:
                    self._apply_token(seq, self._token_for(sampled, batch_id, seq_id), now)
                    updated.append(seq)
                continue
            # A decode on the roster (one per decoding sequence per step when decodes go as
            # chunks): _apply_token inlined on the roster's counters. It has had a first token.
            slot = seq._slot
            inflight[slot] -= 1
            token_id = sampled.get(seq_id)
            if token_id is None:
                raise ValueError(f"micro-batch {batch_id} returned no token for sequence {seq_id}")
            seq.output_token_ids.append(token_id)
            num_tokens[slot] += 1
            last_token[slot] = token_id
            last_token_time[slot] = now
            self._finish_if_last(seq, token_id)
            updated.append(seq)

    @staticmethod
    def _token_for(sampled: Mapping[int, int], batch_id: int, seq_id: int) -> int:
        token_id = sampled.get(seq_id)
        if token_id is None:
            raise ValueError(f"micro-batch {batch_id} returned no token for sequence {seq_id}")
        return token_id

    def _apply_token(self, seq: Sequence, token_id: int, now: float) -> None:
        seq.append_token(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if not self._finish_if_last(seq, token_id) and (
            seq._roster is None and seq.num_uncomputed_tokens <= 1
        ):
            # Its prompt is computed: it decodes from now on (0: its first decode went ahead).
            self.join_roster(seq)

    def _finish_if_last(self, seq: Sequence, token_id: int) -> bool:
        """Ends seq if token_id, just appended, is its last: by length first, then by stop id."""
        if len(seq.output_token_ids) >= seq.max_tokens:
            self._finish(seq, FinishReason.LENGTH)
        elif token_id in seq.stop_token_ids:
            self._finish(seq, FinishReason.STOP)
        else:
            return False
        return True

    def _apply_decodes(
        self,
        block: DecodeBlock,
        batch_id: int,
        sampled: Mapping[int, int],
        block_first_token: int,
        now: float,
        updated: list[Sequence],
    ) -> None:
        """The decode block's tokens, with vector operations on the roster's columns.
        block_first_token: yielding chunks before the block (where its tokens start in a
        sampled map in micro-batch order)."""
        roster = self.roster
        slots, ids, seqs = block.slots, block.seq_ids, block.seqs
        if roster.num_leaves != block.roster_leaves:
            # A sequence that finished or was aborted in the meantime has left its slot (which
            # a later sequence may hold now); seq ids are never reused.
            alive = roster.seq_ids[slots] == np.array(ids, np.int64)
            if not alive.all():
                slots, seqs = slots[alive], seqs[alive]
                ids = [seq_id for seq_id, keep in zip(ids, alive.tolist(), strict=True) if keep]
        if not ids:
            return
        num = len(ids)
        keys = list(sampled)
        first = block_first_token  # where the block's tokens start in sampled, if in order
        if keys[first : first + num] == ids:
            # The usual case: the map is in micro-batch order (as the wire result is).
            tokens = list(sampled.values())[first : first + num]
        else:
            try:
                tokens = list(itemgetter(*ids)(sampled)) if num > 1 else [sampled[ids[0]]]
            except KeyError:
                # A token is missing: apply them one by one up to it, then raise, as for chunks.
                for seq_id, seq in zip(ids, seqs.tolist(), strict=True):
                    seq.num_inflight_batches -= 1
                    self._apply_token(seq, self._token_for(sampled, batch_id, seq_id), now)
                    updated.append(seq)
                raise AssertionError("unreachable: a token was missing") from None
        roster.inflight[slots] -= 1
        deque(map(list.append, roster.outputs[slots], tokens), 0)
        # One conversion of the tokens, for both uses below (it is most of their cost).
        token_column = np.array(tokens, np.int64)
        roster.last_token[slots] = token_column
        num_tokens = roster.num_tokens[slots] + 1
        roster.num_tokens[slots] = num_tokens
        roster.last_token_time[slots] = now
        ends = (num_tokens >= roster.max_num_tokens[slots]).nonzero()[0]
        hits = stop_hits(token_column, roster.stop_ids())
        if len(hits):
            ends = np.union1d(ends, hits)
        seq_list: list[Sequence] = seqs.tolist()
        if len(ends):
            for i in ends.tolist():  # in micro-batch order, as finished_seq_ids lists them
                self._finish_if_last(seq_list[i], tokens[i])
        updated.extend(seq_list)

    def reset_inflight(self) -> list[Sequence]:
        """The pipeline was rebuilt: every micro-batch in flight is lost and the new workers hold
        no sequence state. Every admitted sequence goes back to the queue to be recomputed from
        its prompt plus the tokens it already produced (nothing sampled is lost or repeated).
        Returns the sequences sent back, oldest arrival first."""
        self.quarantine.remember_lost(self._inflight.values())
        self.quarantine.on_trial = None  # the trials start again, from the oldest suspect
        self._inflight.clear()
        self.inflight_decodes.clear()
        self.inflight_prompt_tokens.clear()
        self._finished_since_last_batch = []
        requeued = sorted(self.running.values(), key=_arrival_order)
        for seq in reversed(requeued):  # appendleft: the oldest ends up first in the queue
            seq.num_inflight_batches = 0
            self._preempt(seq)
        for seq in self.waiting:
            seq.needs_worker_state = True
        # Preempted ids were queued for the old workers; the new ones never saw them.
        self._finished_since_last_batch = []
        self.block_manager.drop_cache()  # the new workers' KV caches hold nothing
        return requeued

    # ---- quarantine (quarantine.py) --------------------------------------------------------
    def on_step_fault(self, batch_id: int) -> list[Sequence]:
        """Micro-batch batch_id failed on a worker (the pipeline goes down and is rebuilt: see
        reset_inflight). Its sequences become suspects, and those the quarantine convicts end
        with FinishReason.ERROR: returned, for their streams to end. A batch neither in flight
        nor lost when the pipeline last went down (an old report) changes nothing."""
        quarantine = self.quarantine
        batch = self._inflight.get(batch_id) or quarantine.lost.get(batch_id)
        if batch is None:
            return []
        failed = quarantine.judge(batch, self._live)
        for seq in failed:
            self.abort(seq.seq_id, FinishReason.ERROR)
        return failed

    def _run_trials(self) -> bool:
        """While there are suspects, they run one at a time, alone. True when the one on trial
        may be scheduled (or the trials are over); False while the pipeline drains first."""
        quarantine = self.quarantine
        seq = quarantine.on_trial
        if seq is not None:
            if not quarantine.trial_over():
                return True
            quarantine.release(seq)  # passed
            if not quarantine.active:
                return self._end_trials()  # the last one runs on with the rest
        # A trial starts with nothing else running (after a rebuild nothing is): the one that
        # passed goes back to the queue, to be recomputed in its place.
        if self._inflight:
            return False
        for other in sorted(self.running.values(), key=_arrival_order, reverse=True):
            self._preempt(other)  # appendleft: the oldest ends up first
        seq = quarantine.next_suspect()
        if seq is None:
            return self._end_trials()
        if seq.seq_id in self.forks:
            self._release_held(seq)  # they would fork into its trial: they wait instead
        self.waiting.remove(seq)  # queued: suspects are not held forks, and none runs now
        self.waiting.appendleft(seq)
        quarantine.start_trial(seq)
        return True

    def _end_trials(self) -> bool:
        """Every suspect is tried: the queue (where the passed ones went first) goes back to
        arrival order."""
        self.waiting = deque(sorted(self.waiting, key=_arrival_order))
        return True

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
        if seq._roster is not None:
            self.roster.py_kv_capacity[seq._slot] += bm.block_size
        return block_id

    def _pick_victim(self) -> Sequence | None:
        candidates = [s for s in self.running.values() if s.num_inflight_batches == 0]
        if not candidates:
            return None
        return max(candidates, key=lambda s: (s.arrival_time, s.seq_id))

    # ---- n > 1: forks ---------------------------------------------------------------------
    def _fork(self, leader: Sequence) -> None:
        """The leader's prompt is scheduled whole: its held sequences start from it. Each
        shares the blocks wholly before the last prompt position, gets a copy of the block
        holding that position (made by the next micro-batch) and computes that one token
        itself, for its first token. One that finds no block or no place among the running
        sequences is queued to compute its prompt alone."""
        followers = self.forks.pop(leader.seq_id, [])
        bm = self.block_manager
        last = len(leader.prompt_token_ids) - 1
        alone: list[Sequence] = []
        for seq in followers:
            del self._held[seq.seq_id]
            # One new block: the one holding the last prompt position (the rest are shared).
            if len(self.running) >= self.config.max_num_seqs or not bm.can_admit(1):
                alone.append(seq)
                continue
            self.start_from(seq, leader.block_ids, last, bm.blocks_for(seq.num_tokens))
        self.waiting.extendleft(reversed(alone))

    def start_from(
        self, seq: Sequence, source: list[int], num_cached: int, num_blocks: int
    ) -> None:
        """Admits seq with num_blocks KV blocks, its first num_cached tokens already computed in
        source's blocks (a cached prefix, or a forking leader's prompt): it holds those wholly
        before that point; where the point falls inside a block, it gets a new block that the
        next micro-batch copies from source's before its forward pass (copy-on-write: seq
        writes there from that point on). The rest are new."""
        bm = self.block_manager
        num_shared = num_cached // bm.block_size
        shared = source[:num_shared]
        bm.hold(shared)
        if num_cached % bm.block_size:
            copy_from = source[num_shared]
            bm.hold([copy_from])  # until the copy's micro-batch is built (schedule)
            own = bm.allocate(num_blocks - num_shared)
            self._pending_copies[seq.seq_id] = (copy_from, own[0])
        else:
            own = bm.allocate(num_blocks - num_shared)
        seq.block_ids = shared + own
        seq.num_named_blocks = num_shared
        self.prefix_cache.count_admission(seq, num_cached)
        self._cached_since_last_batch += num_cached
        seq.num_computed_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        self.admit(seq)

    def _release_held(self, leader: Sequence) -> None:
        """The leader ended (or goes on trial, quarantine.py) before its prompt was scheduled
        whole: the sequences waiting for it are queued first, to compute the prompt
        themselves."""
        followers = self.forks.pop(leader.seq_id, [])
        for seq in followers:
            del self._held[seq.seq_id]
        self.waiting.extendleft(reversed(followers))

    # ---- membership -----------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """seq (holding its KV blocks now) joins the running sequences, last in order."""
        seq._admit_no = self._next_admit_no
        self._next_admit_no += 1
        self.running[seq.seq_id] = seq
        self.not_decoding[seq.seq_id] = seq

    def join_roster(self, seq: Sequence) -> None:
        """seq's next work is one decode token: it moves to the decode roster."""
        del self.not_decoding[seq.seq_id]
        self.roster.join(seq, seq._admit_no)

    def _stop_running(self, seq: Sequence) -> None:
        if seq._roster is not None:
            self.roster.leave(seq)
        else:
            self.not_decoding.pop(seq.seq_id, None)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free its blocks (its computed full ones stay cached, for the
        recompute to start from while they last), forget its progress, put it first in the
        queue."""
        self._stop_running(seq)
        self._let_go_of_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.needs_worker_state = True
        seq.num_preemptions += 1
        del self.running[seq.seq_id]
        self.waiting.appendleft(seq)
        self._finished_since_last_batch.append(seq.seq_id)
        self.num_preemptions += 1

    def _let_go_of_blocks(self, seq: Sequence) -> None:
        """seq's blocks go back, its computed full ones named first (decodes fill blocks
        without naming them: naming waits for this, off the per-step path)."""
        copy = self._pending_copies.pop(seq.seq_id, None)
        if copy is not None:
            self.block_manager.free([copy[0]])
        if seq.block_ids:
            self.prefix_cache.register(seq)
            self.block_manager.free(seq.block_ids)
            seq.block_ids = []
        seq.num_named_blocks = 0

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if self.quarantine.active:
            self.quarantine.release(seq)
        self._stop_running(seq)
        if seq.seq_id in self.forks:
            self._release_held(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._let_go_of_blocks(seq)
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
    def num_unscheduled(self) -> int:
        """Sequences no micro-batch has held yet: queued, or admitted before their first chunk
        (a decoding sequence has been scheduled, so only the others are looked at)."""
        queued = sum(1 for seq in self.waiting if seq.first_scheduled_time is None)
        admitted = sum(1 for seq in self.not_decoding.values() if seq.first_scheduled_time is None)
        return queued + admitted

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
            # A decode gone ahead computes the position of a token still in flight.
            ahead = self.config.decode_ahead
            assert seq.num_computed_tokens <= seq.num_tokens + ahead, seq
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_ids, seq
            assert seq.num_computed_tokens == 0 and seq.num_named_blocks == 0, seq
        for seq in self.running.values():
            self.prefix_cache.check_names(seq)
        held = [seq for followers in self.forks.values() for seq in followers]
        assert sorted(s.seq_id for s in held) == sorted(self._held), "held sequences differ"
        for seq in held:
            assert seq.status is SequenceStatus.WAITING and not seq.block_ids, seq
            assert self._held[seq.seq_id] in self._live, f"{seq} waits for an ended leader"
        assert len(self.running) + len(self.waiting) + len(held) == len(self._live)
        assert self._pending_copies.keys() <= self.running.keys(), "a copy for a stopped seq"
        self.roster.check_invariants()
        on_roster = [s for s in self.running.values() if s._roster is not None]
        assert len(on_roster) == self.roster.size
        assert [s.seq_id for s in self.running.values() if s._roster is None] == list(
            self.not_decoding
        ), "not_decoding is not the running sequences off the roster, in admission order"
        assert [int(self.roster.seq_ids[slot]) for slot in self.roster.order()] == [
            s.seq_id for s in on_roster
        ], "the roster's order is not the admission order"
        for seq in self.not_decoding.values():
            assert seq.num_uncomputed_tokens != 1 or not seq.output_token_ids, f"{seq} decodes"
        assert len(self._inflight) <= self.config.max_inflight_batches
        if self.spread_decodes:
            assert self.inflight_decodes.keys() == self._inflight.keys()
        else:
            assert not self.inflight_decodes and not self.roster.num_passed
        if self.spread_prompts:
            assert self.inflight_prompt_tokens.keys() == self._inflight.keys()
        pinned = [[src] for src, _ in self._pending_copies.values()]  # copy sources
        self.block_manager.check_invariants(
            [*(s.block_ids for s in self.running.values()), *pinned]
        )
