"""Automatic prefix caching: a new sequence starts past its longest cached prefix, and what it
reads there is what it would have computed.

Micro-batches run through a fake KV cache that does what the workers do, strictly: block tables
from each chunk's new blocks, the copies before the forward pass, and every token's KV written
at its position, visible only to later micro-batches (a chunk reads what earlier ones wrote, and
its own tokens). A slot holds what the real KV depends on: the token, its position and every
token before it (a key chained over them). At every chunk it checks that each position the chunk
attends to holds that sequence's key there: a wrong hit (a block named for other tokens, a block
read in the very micro-batch that writes it, a cached block evicted or reused while still read,
a cache left over from lost workers) shows as a wrong key.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.scheduler import (
    FinishReason,
    InvalidRequestError,
    MicroBatch,
    RequestParams,
    SamplingParams,
    Scheduler,
    Sequence,
)
from tests.unit.scheduler.factories import FakePipeline, create_scheduler, token_for

BS = 4  # block size in the property test: many block edges in short prompts


def kv_keys(token_ids: list[int]) -> list[int]:
    """What the KV at each position depends on: the token there, the position and every token
    before (a block of the same tokens after another prefix, or at another position, differs)."""
    keys, key = [], 0
    for pos, token_id in enumerate(token_ids):
        key = hash((key, pos, token_id))
        keys.append(key)
    return keys


@dataclass
class StrictKV:
    """Block id -> {slot: KV key} as the workers' caches hold it, and each sequence's table."""

    sched: Scheduler
    block_size: int
    blocks: dict[int, dict[int, int]] = field(default_factory=dict)
    tables: dict[int, list[int]] = field(default_factory=dict)
    tokens_computed: int = 0
    tokens_skipped: int = 0
    """Positions a sequence's first chunk started past (found in the cache)."""

    def run(self, batch: MicroBatch) -> None:
        for seq_id in batch.finished_seq_ids:
            self.tables.pop(seq_id, None)
        copied = {dst: dict(self.blocks.get(src, {})) for src, dst in batch.block_copies}
        self.blocks.update(copied)
        writes: list[tuple[int, int, int]] = []  # (block, slot, key), applied after the batch
        for chunk in batch.chunks:
            if chunk.sampling is not None:
                self.tables[chunk.seq_id] = []
                self.tokens_skipped += chunk.first_position
            table = self.tables[chunk.seq_id]
            table.extend(chunk.new_block_ids)
            seq = self.sched.get(chunk.seq_id)
            assert seq is not None
            assert chunk.token_ids == seq.token_slice(chunk.first_position, chunk.context_len)
            expected = kv_keys(seq.token_slice(0, chunk.context_len))
            bs = self.block_size
            own = {}
            for pos in range(chunk.first_position, chunk.context_len):
                own[pos] = expected[pos]
                writes.append((table[pos // bs], pos % bs, expected[pos]))
            self.tokens_computed += chunk.num_tokens
            held = [
                own.get(pos, self.blocks.get(table[pos // bs], {}).get(pos % bs))
                for pos in range(chunk.context_len)
            ]
            assert held == expected, f"sequence {chunk.seq_id} reads wrong KV at {chunk}"
        for block_id, slot, key in writes:
            self.blocks.setdefault(block_id, {})[slot] = key


class KVPipeline(FakePipeline):
    """FakePipeline whose micro-batches run through a StrictKV, in order, as issued."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched)
        self.kv = StrictKV(sched, sched.block_manager.block_size)

    def fill(self) -> list[MicroBatch]:
        issued = super().fill()
        for batch in issued:
            self.kv.run(batch)
        return issued

    def lose_workers(self) -> None:
        """A stage died: every micro-batch in flight is lost and the new workers hold no KV."""
        self.sched.reset_inflight()
        self.inflight.clear()
        self.kv = StrictKV(self.sched, self.sched.block_manager.block_size)


def add(sched: Scheduler, seq_id: int, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return sched.add_request(seq_id, prompt, RequestParams(max_tokens=max_tokens), 0.0)


def system_prompt(length: int) -> list[int]:
    return [900_000 + i for i in range(length)]


def run_alone(sched: Scheduler, pipe: KVPipeline, seq: Sequence) -> None:
    while not seq.is_finished:
        pipe.fill()
        pipe.complete_oldest()
        sched.check_invariants()


# ---- what a user of the cache sees ------------------------------------------------------------
@pytest.mark.parametrize(
    ("shared", "cached"),
    [(15, 0), (16, 16), (17, 16), (31, 16), (32, 32), (33, 32)],
)
def test_a_second_request_computes_only_what_follows_the_shared_full_blocks(
    shared: int, cached: int
) -> None:
    sched = create_scheduler(budget_tokens=64)
    pipe = KVPipeline(sched)
    run_alone(sched, pipe, add(sched, 1, [*system_prompt(shared), 1, 2, 3]))
    second = add(sched, 2, [*system_prompt(shared), 7, 8, 9, 10])
    (batch,) = pipe.fill()
    ((first, num),) = [(c.first_position, c.num_tokens) for c in batch.chunks]
    assert (first, num) == (cached, shared + 4 - cached)
    assert batch.num_tokens == shared + 4 - cached  # the budget counts what is computed
    run_alone(sched, pipe, second)
    stats = sched.prefix_cache.stats
    assert (stats.num_requests, stats.num_hit_requests) == (2, 1 if cached else 0)
    assert stats.num_cached_tokens == cached


@pytest.mark.parametrize("prompt_len", [16, 32, 33])
def test_a_whole_cached_prompt_still_computes_its_last_token(prompt_len: int) -> None:
    sched = create_scheduler(budget_tokens=64)
    pipe = KVPipeline(sched)
    first = add(sched, 1, system_prompt(prompt_len))
    run_alone(sched, pipe, first)
    second = add(sched, 2, system_prompt(prompt_len))
    (batch,) = pipe.fill()
    chunk = batch.chunks[0]
    cached_full = prompt_len // 16 * 16
    assert (chunk.first_position, chunk.num_tokens) == (
        min(cached_full, prompt_len - 1),
        prompt_len - min(cached_full, prompt_len - 1),
    )
    if prompt_len % 16 == 0:
        # Its last token lies in a cached block: the block is copied, never written shared.
        ((src, dst),) = batch.block_copies
        assert second.block_ids[-1] == dst != src
    else:
        assert batch.block_copies == []
    run_alone(sched, pipe, second)
    assert second.output_token_ids == [token_for(2, prompt_len - 1 + i) for i in range(4)]


def test_a_prefix_is_not_read_in_the_micro_batch_that_writes_it() -> None:
    sched = create_scheduler(budget_tokens=256)
    pipe = KVPipeline(sched)
    add(sched, 1, [*system_prompt(48), 1])
    add(sched, 2, [*system_prompt(48), 2])
    (batch,) = pipe.fill()  # both admitted at once: the second computes the prefix too
    assert [c.first_position for c in batch.chunks] == [0, 0]
    add(sched, 3, [*system_prompt(48), 3])
    pipe.complete_oldest()
    batches = pipe.fill()
    assert [c.first_position for c in batches[0].chunks if c.seq_id == 3] == [48]


def test_freed_prefixes_stay_cached_until_their_room_is_needed_least_recent_first() -> None:
    sched = create_scheduler(budget_tokens=64, num_blocks=8, block_size=4, max_model_len=64)
    pipe = KVPipeline(sched)
    bm = sched.block_manager
    a, b = [100 + i for i in range(8)], [200 + i for i in range(8)]
    run_alone(sched, pipe, add(sched, 1, [*a, 1], max_tokens=1))  # 3 blocks, 2 full: cached
    run_alone(sched, pipe, add(sched, 2, [*b, 1], max_tokens=1))
    assert bm.num_cached_blocks == 4 and bm.num_free == 8 and bm.num_evictions == 0
    run_alone(sched, pipe, add(sched, 3, [*a, 2], max_tokens=1))  # a is used again: recent
    # 6 blocks for a new prompt: the 4 unnamed free ones, then the least recent cached (b's).
    run_alone(sched, pipe, add(sched, 4, [300 + i for i in range(22)], max_tokens=1))
    assert bm.num_evictions == 2
    third = add(sched, 5, [*a, 3], max_tokens=1)
    (batch,) = pipe.fill()
    assert batch.chunks[0].first_position == 8  # a survived
    run_alone(sched, pipe, third)
    fourth = add(sched, 6, [*b, 3], max_tokens=1)
    (batch,) = pipe.fill()
    assert batch.chunks[0].first_position == 0  # b was evicted
    run_alone(sched, pipe, fourth)


def test_a_preempted_sequence_recomputes_from_its_own_cached_blocks() -> None:
    sched = create_scheduler(budget_tokens=32, num_blocks=8, block_size=4)
    pipe = KVPipeline(sched)
    add(sched, 1, system_prompt(6), max_tokens=12)
    late = add(sched, 2, [5, 6, 7, 8, 9, 10], max_tokens=12)
    while late.num_preemptions == 0:
        pipe.fill()
        pipe.complete_oldest()
        sched.check_invariants()
    pipe.run_to_completion()
    assert late.output_token_ids == [token_for(2, 5 + i) for i in range(12)]
    assert pipe.kv.tokens_skipped > 0  # the recompute found some of its blocks again


def test_a_lost_pipeline_empties_the_cache() -> None:
    sched = create_scheduler(budget_tokens=64, pipeline_depth=2, spread_prompts=False)
    pipe = KVPipeline(sched)
    run_alone(sched, pipe, add(sched, 1, system_prompt(40)))
    assert sched.block_manager.num_cached_blocks == 2
    pipe.lose_workers()
    assert sched.block_manager.num_cached_blocks == 0
    second = add(sched, 2, system_prompt(40))
    (batch,) = pipe.fill()
    assert batch.chunks[0].first_position == 0  # the new workers hold nothing: all computed
    run_alone(sched, pipe, second)


def test_prompt_logprobs_requests_compute_every_prompt_token() -> None:
    sched = create_scheduler(budget_tokens=64)
    pipe = KVPipeline(sched)
    run_alone(sched, pipe, add(sched, 1, system_prompt(40)))
    params = RequestParams(max_tokens=2, sampling=SamplingParams(prompt_logprobs=1))
    seq = sched.add_request(2, system_prompt(40), params, 0.0)
    (batch,) = pipe.fill()
    assert batch.chunks[0].first_position == 0  # the last stage scores every prompt row
    run_alone(sched, pipe, seq)


def test_with_caching_off_nothing_is_named_or_found() -> None:
    sched = create_scheduler(budget_tokens=64, prefix_caching=False)
    pipe = KVPipeline(sched)
    run_alone(sched, pipe, add(sched, 1, system_prompt(40)))
    second = add(sched, 2, system_prompt(40))
    (batch,) = pipe.fill()
    assert batch.chunks[0].first_position == 0
    assert sched.block_manager.num_cached_blocks == 0
    run_alone(sched, pipe, second)
    assert sched.prefix_cache.stats.num_requests == 0


def test_the_invariant_check_catches_a_block_named_for_other_tokens() -> None:
    # Guards the property test below: a wrong name must not pass check_invariants.
    sched = create_scheduler(budget_tokens=64)
    pipe = KVPipeline(sched)
    seq = add(sched, 1, system_prompt(40), max_tokens=8)
    pipe.fill()
    bm = sched.block_manager
    sched.check_invariants()
    name = bm.hash_of(seq.block_ids[1])
    assert name is not None
    bm.drop_cache()
    bm.register(seq.block_ids[1], sched.prefix_cache.hashes(seq, 1)[0])  # block 0's name
    with pytest.raises(AssertionError, match="another prefix"):
        sched.check_invariants()
    bm.drop_cache()
    bm.register(seq.block_ids[1], name)
    sched.check_invariants()


# ---- any mix --------------------------------------------------------------------------------
@dataclass
class Req:
    arrival_step: int
    head: int
    """Index of a one-block head before the prefix (0: none): the same blocks after another
    head are another prefix."""
    prefix: int
    """Index of the shared prefix it starts with (several requests draw the same one)."""
    prefix_len: int
    suffix_len: int
    max_tokens: int
    n: int


PREFIXES = [[800_000 + 1000 * p + i for i in range(64)] for p in range(3)]
HEADS = [[], [1, 2, 3, 4], [5, 6, 7, 8]]

reqs_strategy = st.lists(
    st.builds(
        Req,
        arrival_step=st.integers(0, 40),
        head=st.integers(0, 2),
        prefix=st.integers(0, 2),
        # Around the block edges (block size 4), and whole prompts shared (suffix 0).
        prefix_len=st.sampled_from([0, 3, 4, 5, 7, 8, 9, 16, 17, 40]),
        suffix_len=st.integers(0, 12),
        max_tokens=st.integers(1, 10),
        n=st.sampled_from([1, 1, 1, 2, 3]),
    ),
    min_size=1,
    max_size=16,
)


def _submit(sched: Scheduler, seq_id: int, req: Req) -> list[Sequence]:
    prompt = (
        HEADS[req.head]
        + PREFIXES[req.prefix][: req.prefix_len]
        + [seq_id * 100 + i for i in range(req.suffix_len)]
    )
    if not prompt:
        prompt = [seq_id * 100]
    params = [
        RequestParams(max_tokens=req.max_tokens, sampling=SamplingParams(seed=i))
        for i in range(req.n)
    ]
    try:
        return sched.add_request_group(list(range(seq_id, seq_id + req.n)), prompt, params, 0.0)
    except InvalidRequestError:  # more blocks than the cache has: refused, nothing queued
        return []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=reqs_strategy,
    pp=st.integers(1, 3),
    budget=st.sampled_from([4, 8, 16, 64]),
    num_blocks=st.integers(14, 60),
    aborts=st.dictionaries(st.integers(1, 80), st.integers(0, 40), max_size=3),
    losses=st.lists(st.integers(1, 80), max_size=2),
    policy=st.sampled_from(["sarathi", "vllm", "orca"]),
)
def test_any_mix_reads_only_right_kv_and_frees_every_block(
    reqs: list[Req],
    pp: int,
    budget: int,
    num_blocks: int,
    aborts: dict[int, int],
    losses: list[int],
    policy: str,
) -> None:
    """Random sharing (prefixes cut around block edges, whole prompts, n > 1 forks), eviction
    (few blocks), preemption, aborts and lost pipelines: every chunk reads its own tokens'
    KV, the invariants (names included) hold at every step, no block leaks, and every stream is
    whole."""
    sched = create_scheduler(
        policy=policy,
        budget_tokens=budget,
        pipeline_depth=pp,
        num_blocks=num_blocks,
        block_size=BS,
        max_num_seqs=min(6, budget),
        max_model_len=128,
    )
    pipe = KVPipeline(sched)
    pending = deque(sorted(reqs, key=lambda r: r.arrival_step))
    seqs: list[Sequence] = []
    next_id = 1
    for step in range(5_000):
        while pending and pending[0].arrival_step <= step:
            req = pending.popleft()
            seqs += _submit(sched, next_id, req)
            next_id += req.n
        if step in aborts and seqs:
            sched.abort(seqs[aborts[step] % len(seqs)].seq_id)
        if step in losses:
            pipe.lose_workers()
            sched.check_invariants()
        pipe.fill()
        if not pipe.inflight:
            assert pending or not sched.has_unfinished, "stuck"
            if not pending:
                break
            continue
        pipe.complete_oldest()
        sched.check_invariants()
    assert sched.block_manager.num_free == num_blocks, "blocks leaked"
    for seq in seqs:
        num_prompt = len(seq.prompt_token_ids)
        assert seq.output_token_ids == [
            token_for(seq.seq_id, num_prompt - 1 + i) for i in range(len(seq.output_token_ids))
        ]
        assert seq.finish_reason in (FinishReason.LENGTH, FinishReason.ABORT)


def test_the_mix_above_hits_evicts_and_preempts() -> None:
    # Guards the property test against testing nothing: a fixed mix of its kind must do all three.
    sched = create_scheduler(budget_tokens=16, num_blocks=20, block_size=BS, max_num_seqs=6)
    pipe = KVPipeline(sched)
    next_id = 1
    for i in range(12):
        req = Req(0, i % 3, i % 2, 17, 5, 10, 1 + i % 3)
        _submit(sched, next_id, req)
        next_id += req.n
    pipe.run_to_completion()
    assert sched.prefix_cache.stats.num_hit_requests > 0
    assert sched.block_manager.num_evictions > 0
    assert sched.num_preemptions > 0


def test_a_resumed_stream_starts_past_the_blocks_its_cut_run_left() -> None:
    sched = create_scheduler(budget_tokens=64)
    pipe = KVPipeline(sched)
    cut = add(sched, 1, system_prompt(20), max_tokens=30)
    run_alone(sched, pipe, cut)
    received = cut.output_token_ids[:17]  # the client had these when the stream was cut
    resumed = sched.add_request(
        2, system_prompt(20), RequestParams(max_tokens=30), 0.0, output_token_ids=received
    )
    (batch,) = pipe.fill()
    # Prompt and received tokens: 37, of which 2 full blocks (32) were named when the cut run
    # let go of its blocks; the rest is computed, and the stream goes on from token 17.
    assert [(c.first_position, c.num_tokens) for c in batch.chunks] == [(32, 5)]
    run_alone(sched, pipe, resumed)
    assert resumed.output_token_ids[:17] == received
    assert resumed.output_token_ids[17:] == [token_for(2, 19 + i) for i in range(17, 30)]
