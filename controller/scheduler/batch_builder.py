"""Building one micro-batch: the moves a policy may make, with the KV accounting they imply.

A policy decides the order and the mix (decodes, ongoing prefills, new requests); this class does
the bookkeeping every policy shares: readiness in a pipeline, block allocation, preemption by
recompute, and the token budget.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

import numpy as np
import numpy.typing as npt

from controller.scheduler.batch import DecodeBlock, ScheduledChunk, TokenHistory
from controller.scheduler.scheduler_state import SchedulerState
from controller.scheduler.sequence import Sequence

# ScheduledChunk's generated __new__ is a Python function; tuple.__new__ builds the same record
# in C, for the per-decode records.
_new_chunk = tuple.__new__


class BatchBuilder:
    def __init__(self, scheduler: SchedulerState, now: float) -> None:
        self._sched = scheduler
        self._now = now
        self.chunks: list[ScheduledChunk] = []
        """Every chunk but the decodes that go as a vector block, in `decodes`."""
        self.decodes: DecodeBlock | None = None
        self.decodes_at = 0
        """Index in `chunks` the decode block goes before."""
        self._decodes_added = False
        self.num_tokens = 0
        config = scheduler.config
        self.idle = (
            bool(config.idle_budget_tokens)
            and scheduler.roster.size == 0
            and not scheduler.num_inflight_batches
        )
        """No sequence decodes, nor can one start while this micro-batch runs (idle_budget_tokens
        is only set with PP = 1, and nothing is in flight: with decodes ahead a micro-batch is
        built while another runs, whose last prompt chunks would yield first tokens): TBT is not
        at stake, and the micro-batch takes the idle budget."""
        self.budget_tokens = config.idle_budget_tokens if self.idle else config.budget_tokens
        self.num_decodes = 0
        """Decodes add_decodes put in (as a block or as chunks)."""
        self.step_cost = config.step_cost if config.time_budget_s and not self.idle else None
        """Set when the micro-batch is also budgeted in predicted time."""
        self.predicted_s = self.step_cost.fixed_s if self.step_cost else 0.0
        self.num_prompt_tokens = 0
        """Tokens of prompt chunks (not decodes) in the micro-batch."""
        self._prompt_cap: int | None = None
        """Prompt tokens this micro-batch may take in all (_share_of_prompts), once asked."""
        self.prefilled: list[Sequence] = []
        """Sequences given a prompt (or recompute) chunk: their new full blocks get named once
        the micro-batch is built (prefix caching), not before, so none is read in the very
        micro-batch that writes it."""

    @property
    def budget_left(self) -> int:
        return self.budget_tokens - self.num_tokens

    @property
    def prompt_left(self) -> int:
        """Prompt tokens this micro-batch may still take: the budget left, and with spread
        prompts its share of the prompt tokens there are (prompt_cap)."""
        if self._prompt_cap is None:
            self._prompt_cap = self._share_of_prompts()
        return min(self.budget_left, self._prompt_cap - self.num_prompt_tokens)

    def _share_of_prompts(self) -> int:
        """With spread prompts: 1/PP of the prompt tokens of this round of PP micro-batches
        (those in flight, plus the prompt tokens not yet scheduled: running prompts' rest, then
        the waiting ones the running-sequence cap lets in, less what their cached prefixes
        hold, counted only until there is enough for PP micro-batches), in whole tiles and at
        least one; no cap when there is enough, or when what the share would leave unscheduled
        is under a tile. Two stages running a full micro-batch beside one of decodes alone idle
        one stage for the difference; two half ones keep both busy and finish the prompt sooner
        (its chunks follow each other through the pipeline). A sliver is not worth a step of
        its own: each step pays the stage's fixed cost (reading its weights), so 40 tokens go
        whole rather than as 32 and 8, and 65 as 32 and 33 rather than 64 and 1."""
        sched = self._sched
        if not sched.spread_prompts:
            return self.budget_tokens
        depth = sched.config.pipeline_depth
        enough = depth * self.budget_tokens
        inflight = sum(sched.inflight_prompt_tokens.values())
        available = inflight
        for seq in sched.not_decoding.values():
            available += seq.num_uncomputed_tokens
            if available >= enough:
                return self.budget_tokens
        admissible = sched.config.max_num_seqs - len(sched.running)  # the rest cannot start
        for seq in islice(sched.waiting, max(0, admissible)):
            _, num_cached = sched.prefix_cache.lookup(seq)  # what admission will start from
            available += seq.num_tokens - num_cached
            if available >= enough:
                return self.budget_tokens
        tile = sched.config.tile_tokens
        share = max(tile, available // depth // tile * tile)
        if available - inflight - share < tile:
            return self.budget_tokens  # the rest now, not as a sliver of its own
        return share

    @property
    def num_running(self) -> int:
        return len(self._sched.running)

    def add_decodes(self, capped: bool) -> int:
        """Adds one token for sequences whose next work is a decode and whose last token is back,
        in admission order; capped: stop at the token budget. Preempts (latest arrival first)
        when a decode needs a new KV block and none is free. Returns the number added.

        With one micro-batch in flight at a time (PP = 1) every ready decode goes. With PP > 1
        the decoding sequences are spread over the PP micro-batches in flight (see
        `_spread_quota`): a micro-batch takes at most about 1/PP of them, so that decodes do not
        travel bunched in one micro-batch while the other pipeline slots carry nothing. Which
        ready decodes go first: those passed over by more earlier micro-batches (a decode
        passed over PP - 1 times goes whatever the quota), then admission order. The bound this
        gives: a ready decode goes into one of the next PP micro-batches that add decodes (it is
        passed over at most PP - 1 times), unless a KV block for it cannot be had.

        This runs for every decoding sequence on every step. Many decodes go as one vector
        block over the decode roster's columns (a few numpy operations, whatever their number);
        a few go as per-sequence chunks, because each numpy call costs a microsecond or so and a
        dozen of them outweigh a short Python loop (scheduler.vector_decodes_from draws the
        line)."""
        assert not self._decodes_added, "add_decodes called twice for one micro-batch"
        self._decodes_added = True
        first_chunk = len(self.chunks)
        added = self._add_decodes(capped)
        if self._sched.config.decode_ahead and self._sched.not_decoding:
            added += self._add_first_decodes_ahead(capped)
        self.num_decodes = added
        if self.step_cost is not None and added:
            # A decode at position q attends q + 1 keys.
            contexts = sum(c.first_position + 1 for c in self.chunks[first_chunk:])
            if self.decodes is not None:
                contexts += int(self.decodes.positions.sum()) + len(self.decodes.seq_ids)
            self.predicted_s += self.step_cost.decodes_s(added, contexts)
        return added

    def _add_first_decodes_ahead(self, capped: bool) -> int:
        """With decodes ahead: the first decode of each sequence whose one thing in flight is
        the chunk that yields its first token (a prompt's last chunk, a recompute's), which the
        worker feeds it. Otherwise that decode could only go into the micro-batch after the
        next, and the sequence's first two tokens would come two steps apart. Not behind a chunk
        of this micro-batch (a policy may add prompt chunks before decodes): the worker samples
        that chunk's token only after the step, and a sequence goes once a micro-batch."""
        sched = self._sched
        bs = sched.block_manager.block_size
        added = 0
        for seq in tuple(sched.not_decoding.values()):
            if capped and self.num_tokens + added >= self.budget_tokens:
                break
            position = seq.num_computed_tokens
            if position != seq.num_tokens or seq.num_inflight_batches != 1:
                continue  # prefilling, or preempted by a decode of this loop
            if any(s is seq for s in self.prefilled):
                continue  # its one thing in flight is its chunk in this micro-batch
            if position + 1 >= seq.max_num_tokens:
                continue  # the token in flight is its last by length
            new_block_ids: tuple[int, ...] = ()
            if position >= len(seq.block_ids) * bs:
                block_id = sched.grow_by_one_block(seq)
                if block_id is None:
                    continue
                new_block_ids = (block_id,)
            seq.num_computed_tokens = position + 1
            seq.num_inflight_batches += 1
            self.chunks.append(
                ScheduledChunk(seq.seq_id, position, 1, True, new_block_ids, [], None, None, True)
            )
            added += 1
        self.num_tokens += added
        return added

    def _time_limited(self, first_position: int, limit: int) -> int:
        """limit, or fewer tokens where the time budget ends first. The first prompt chunk of a
        micro-batch gets at least a tile, so that prompts progress whatever the decodes cost."""
        cost = self.step_cost
        if cost is None or limit <= 0:
            return limit
        fits = cost.largest_chunk(first_position, self.time_budget_s - self.predicted_s, limit)
        if self.num_prompt_tokens == 0:
            fits = max(fits, min(limit, self._sched.config.tile_tokens))
        return fits

    @property
    def time_budget_s(self) -> float:
        return self._sched.config.time_budget_s

    def _add_decodes(self, capped: bool) -> int:
        sched = self._sched
        roster = sched.roster
        if not roster.size:
            return 0
        order = roster.order()
        if roster.size < sched.vector_decodes_from:
            limit = self.budget_tokens - self.num_tokens if capped else roster.size
            if sched.spread_decodes:
                return self._add_spread_decodes_as_chunks(order, limit)
            return self._walk_decodes(roster.seqs[order].tolist(), limit)
        ready_slots, ready_positions = self._ready_decodes(order)
        limit = self.budget_tokens - self.num_tokens if capped else len(ready_slots)
        slots, positions, chosen = self._pick_decodes(ready_slots, ready_positions, limit)
        if not len(slots):
            if chosen is not None:
                self._settle_passes(roster.seqs[ready_slots].tolist())
            return 0
        crossing = (positions >= roster.kv_capacity[slots]).nonzero()[0]
        if len(crossing) > sched.block_manager.num_free:
            # Some decode would preempt: the exact one-by-one walk decides who.
            if not sched.spread_decodes:
                return self._walk_decodes(roster.seqs[order].tolist(), limit)
            return self._walk_spread_decodes(
                roster.seqs[ready_slots].tolist(), roster.seqs[slots].tolist(), len(slots)
            )
        if chosen is not None:
            # Every chosen decode goes (no block is short): passes settle with vector operations.
            roster.passes[ready_slots] = np.where(chosen, 0, roster.passes[ready_slots] + 1)
            roster.num_passed = len(ready_slots) - len(slots)
        self._place_decodes(slots, positions, crossing)
        return len(slots)

    def _ready_decodes(
        self, order: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The roster slots (admission order) whose next decode can go now, and its positions."""
        sched = self._sched
        roster = sched.roster
        computed = roster.computed[order]
        num_tokens = roster.num_tokens[order]
        ready = computed < num_tokens  # else its last token is still in flight
        if not sched.config.pipeline_prefill_chunks:
            ready &= roster.inflight[order] == 0
        if sched.config.decode_ahead:
            # Its one decode in flight yields a token that is not its last by length.
            ready |= (
                (computed == num_tokens)
                & (roster.inflight[order] == 1)
                & (num_tokens + 1 < roster.max_num_tokens[order])
            )
        # ndarray.nonzero, not np.flatnonzero: the same on 1-d arrays, without its wrappers'
        # cost (a few microseconds, on every step).
        if np.count_nonzero(ready) == len(ready):  # the usual case with one batch in flight
            return order, computed
        picked = ready.nonzero()[0]
        return order[picked], computed[picked]

    def _pick_decodes(
        self, slots: npt.NDArray[np.int64], positions: npt.NDArray[np.int64], limit: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_] | None]:
        """The ready decodes this micro-batch takes, at most limit: the first in admission order,
        or with PP > 1 the spread's quota, most passed over first. The mask over the ready ones
        comes back too when passes change (None when they do not)."""
        sched = self._sched
        if not sched.spread_decodes:
            if limit < len(slots):
                limit = max(limit, 0)
                return slots[:limit], positions[:limit], None
            return slots, positions, None
        roster = sched.roster
        num_ready = len(slots)
        quota = self._spread_quota()
        if num_ready <= min(quota, limit) and not roster.num_passed:
            return slots, positions, None
        passes = roster.passes[slots]
        forced = int(np.count_nonzero(passes >= sched.config.pipeline_depth - 1))
        take = max(min(max(quota, forced), limit), 0)
        chosen = np.zeros(num_ready, np.bool_)
        # Most passed over first, then admission order (a stable sort keeps it).
        chosen[np.argsort(-passes, kind="stable")[:take]] = True
        if take < num_ready:
            return slots[chosen], positions[chosen], chosen
        return slots, positions, chosen

    def _place_decodes(
        self,
        slots: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        crossing: npt.NDArray[np.int64],
    ) -> None:
        """Puts the picked decodes in as one vector block; crossing: the indices into slots whose
        position needs a new KV block (there are enough free)."""
        roster = self._sched.roster
        bm = self._sched.block_manager
        new_block_ids: list[int] = []
        if len(crossing):
            new_block_ids = bm.allocate(len(crossing))
            growing = slots[crossing]
            deque(map(list.append, roster.block_lists[growing], new_block_ids), 0)
            roster.kv_capacity[growing] += bm.block_size
        tokens = roster.last_token[slots]
        ahead_at: list[int] = []
        if self._sched.config.decode_ahead:
            # Those whose decode in flight yields the token they take (the worker has it).
            ahead = (positions == roster.num_tokens[slots]).nonzero()[0]
            if len(ahead):
                tokens = tokens.copy()
                tokens[ahead] = 0
                ahead_at = ahead.tolist()
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
            tokens.tolist(),
            ahead_at,
        )
        self.decodes_at = len(self.chunks)
        self.num_tokens += len(slots)

    def _spread_quota(self) -> int:
        """With PP > 1: how many decodes this micro-batch takes at most (decodes passed over
        PP - 1 times go beyond it). D decoding sequences (ready or in flight) over PP micro-batches
        are q = D // PP each and one more for r = D % PP of them: this one takes q + 1 while
        fewer than r of the micro-batches in flight carry more than q decodes, else q; at least
        1, so a free pipeline slot never stays empty while a decode is ready."""
        sched = self._sched
        quota, extra = divmod(sched.roster.size, sched.config.pipeline_depth)
        if extra and sum(1 for n in sched.inflight_decodes.values() if n > quota) < extra:
            quota += 1
        return quota or 1

    def _add_spread_decodes_as_chunks(self, order: npt.NDArray[np.int64], limit: int) -> int:
        """add_decodes with PP > 1 for a few decodes: the same choice as the vector path, in
        Python."""
        sched = self._sched
        roster = sched.roster
        computed, num_tokens = roster.py_computed, roster.py_num_tokens
        inflight, passes = roster.py_inflight, roster.py_passes
        wait_for_batch = not sched.config.pipeline_prefill_chunks
        ready = [
            seq
            for seq in roster.seqs[order].tolist()
            if num_tokens[seq._slot] - computed[seq._slot] == 1
            and not (wait_for_batch and inflight[seq._slot])
        ]
        num_ready = len(ready)
        quota = self._spread_quota()
        if num_ready <= min(quota, limit) and not roster.num_passed:
            return self._walk_spread_decodes(ready, ready, num_ready)
        counts = [passes[seq._slot] for seq in ready]
        forced = sum(1 for n in counts if n >= sched.config.pipeline_depth - 1)
        take = max(min(max(quota, forced), limit), 0)
        if take < num_ready:
            # Most passed over first, then admission order (sorted is stable).
            first = sorted(range(num_ready), key=lambda i: -counts[i])[:take]
            chosen = [ready[i] for i in sorted(first)]
        else:
            chosen = ready
        return self._walk_spread_decodes(ready, chosen, take)

    def _walk_spread_decodes(self, ready: list[Sequence], chosen: list[Sequence], take: int) -> int:
        """The walk with PP > 1: the chosen decodes (admission order); if some of them could not
        have a KV block (or were preempted for one), ready decodes not chosen take their places,
        most passed over first, up to take in all. Then the passes settle."""
        added = self._walk_decodes(chosen, len(chosen))
        if added < take and len(chosen) < len(ready):
            passes = self._sched.roster.py_passes
            taken = set(chosen)
            spare = [seq for seq in ready if seq not in taken and seq._roster is not None]
            spare.sort(key=lambda seq: -passes[seq._slot])  # stable: then admission order
            added += self._walk_decodes(spare, take - added)
        self._settle_passes(ready)
        return added

    def _settle_passes(self, ready: list[Sequence]) -> None:
        """After a micro-batch took its decodes: each decode that was ready and did not go is
        passed over once more; those that went start again from 0."""
        roster = self._sched.roster
        computed, num_tokens, passes = roster.py_computed, roster.py_num_tokens, roster.py_passes
        num_passed = 0
        for seq in ready:
            if seq._roster is None:
                continue  # preempted meanwhile
            slot = seq._slot
            if computed[slot] < num_tokens[slot]:
                passes[slot] += 1
                num_passed += 1
            elif passes[slot]:
                passes[slot] = 0
        roster.num_passed = num_passed

    def _walk_decodes(self, seqs: list[Sequence], limit: int) -> int:
        """add_decodes one sequence at a time, each decode a chunk of its own: for a few
        decodes, and when KV blocks may run out (each decode grows, and so perhaps preempts,
        before the next one is looked at). seqs: candidates in admission order."""
        sched = self._sched
        roster = sched.roster
        wait_for_batch = not sched.config.pipeline_prefill_chunks
        decode_ahead = sched.config.decode_ahead
        # The array.array twins of the columns: one slot at a time, Python ints are cheaper.
        computed, num_tokens = roster.py_computed, roster.py_num_tokens
        inflight, kv_capacity = roster.py_inflight, roster.py_kv_capacity
        append = self.chunks.append
        added = 0
        for seq in seqs:
            if seq._roster is None:
                continue  # preempted by an earlier decode of this loop
            slot = seq._slot
            position = computed[slot]
            ahead = False
            if num_tokens[slot] - position != 1:
                # Its last token is still in flight: it may go ahead (as in _ready_decodes).
                ahead = (
                    decode_ahead
                    and num_tokens[slot] == position
                    and inflight[slot] == 1
                    and position + 1 < roster.max_num_tokens[slot]
                )
                if not ahead:
                    continue
            elif wait_for_batch and inflight[slot]:
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
                        [] if ahead else [seq.output_token_ids[-1]],
                        None,  # sampling
                        None,  # history
                        ahead,
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
                sched.config.max_chunk_tokens(seq.num_computed_tokens, self.idle),
                self.prompt_left,
            )
            chunk = self._time_limited(seq.num_computed_tokens, chunk)
            if chunk <= 0:
                continue  # over the time budget; a prompt less far along may still fit
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
        trial = sched.quarantine.on_trial
        while sched.waiting and len(sched.running) < sched.config.max_num_seqs:
            seq = sched.waiting[0]
            if trial is not None and seq is not trial:
                break  # a suspect on trial runs alone (quarantine.py)
            # It starts past its longest cached prefix; the budget counts what it computes.
            cached_blocks, num_cached = sched.prefix_cache.lookup(seq)
            remaining = seq.num_tokens - num_cached
            if chunked:
                chunk = min(
                    remaining,
                    sched.config.max_chunk_tokens(num_cached, self.idle),
                    self.prompt_left,
                )
                chunk = self._time_limited(num_cached, chunk)
                if chunk <= 0:
                    break
            else:
                chunk = remaining
                if prefill_tokens and prefill_tokens + chunk > self.budget_tokens:
                    break
            num_blocks = bm.blocks_for(seq.num_tokens)
            num_shared = num_cached // bm.block_size
            # Cached blocks nobody holds leave the free pool too once held (a copied one too).
            taken = cached_blocks[: -(-num_cached // bm.block_size)]
            if not bm.can_admit(num_blocks - num_shared + bm.num_unheld(taken)):
                break
            sched.waiting.popleft()
            sched.start_from(seq, cached_blocks, num_cached, num_blocks)
            self._add(seq, chunk, tuple(seq.block_ids))
            prefill_tokens += chunk
            admitted += 1
        return admitted

    def _add(self, seq: Sequence, num_tokens: int, new_block_ids: tuple[int, ...]) -> None:
        start = seq.num_computed_tokens
        end = start + num_tokens
        sampling = None
        history = None
        if seq.needs_worker_state:
            # The workers meet the sequence here: its whole block table comes with it (a forked
            # sequence's shared blocks too).
            new_block_ids = tuple(seq.block_ids)
            sampling = seq.params.sampling
            seq.needs_worker_state = False
            if sampling.needs_history:
                history = TokenHistory(
                    seq.prompt_token_ids, list(seq.output_token_ids), seq.stop_token_ids
                )
        self.chunks.append(
            ScheduledChunk(
                seq.seq_id,
                start,
                num_tokens,
                end == seq.num_tokens,
                new_block_ids,
                seq.token_slice(start, end),
                sampling,
                history,
            )
        )
        if self.step_cost is not None:
            self.predicted_s += self.step_cost.chunk_s(start, num_tokens)
        self.num_prompt_tokens += num_tokens
        seq.num_computed_tokens = end
        self.prefilled.append(seq)
        seq.num_inflight_batches += 1
        forks = self._sched.forks
        if forks and end >= len(seq.prompt_token_ids) and seq.seq_id in forks:
            self._sched.forking.append(seq)  # its n - 1 siblings fork once the batch is built
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self._now
        self.num_tokens += num_tokens
        if end == seq.num_tokens - 1 and seq.output_token_ids:
            self._sched.join_roster(seq)  # a recompute that stops one token short: it decodes
