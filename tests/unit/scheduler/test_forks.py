"""n > 1: the sequences of one request share their prompt's KV blocks (copy-on-write).

Every test runs micro-batches through a fake KV cache that does what the workers do (block
tables from each chunk's new blocks, the copies before the forward pass, every token's KV
written at its position) and checks, at every chunk, that each position the chunk attends to
holds that sequence's token there: a shared block overwritten, a copy missed or made too early,
or a block table that is wrong shows as a wrong token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.scheduler import MicroBatch, RequestParams, SamplingParams, Scheduler
from tests.unit.scheduler.factories import FakePipeline, create_scheduler


@dataclass
class FakeKVCache:
    """Block id -> {slot: token id}, and each sequence's block table, as the workers keep them."""

    sched: Scheduler
    block_size: int
    blocks: dict[int, dict[int, int]] = field(default_factory=dict)
    tables: dict[int, list[int]] = field(default_factory=dict)
    tokens_computed: int = 0

    def run(self, batch: MicroBatch) -> None:
        for seq_id in batch.finished_seq_ids:
            self.tables.pop(seq_id, None)
        for src, dst in batch.block_copies:
            self.blocks[dst] = dict(self.blocks.get(src, {}))
        for chunk in batch.chunks:
            if chunk.sampling is not None:
                self.tables[chunk.seq_id] = []
            table = self.tables[chunk.seq_id]
            table.extend(chunk.new_block_ids)
            for i, token_id in enumerate(chunk.token_ids):
                pos = chunk.first_position + i
                self.blocks.setdefault(table[pos // self.block_size], {})[pos % self.block_size] = (
                    token_id
                )
            self.tokens_computed += chunk.num_tokens
            seq = self.sched.get(chunk.seq_id)
            assert seq is not None
            expected = seq.token_slice(0, chunk.context_len)
            held = [
                self.blocks.get(table[pos // self.block_size], {}).get(pos % self.block_size)
                for pos in range(chunk.context_len)
            ]
            assert held == expected, f"sequence {chunk.seq_id}'s KV is wrong at {chunk}"


class KVPipeline(FakePipeline):
    """FakePipeline whose micro-batches write and check a FakeKVCache, in order, as issued."""

    def __init__(self, sched: Scheduler, block_size: int = 16) -> None:
        super().__init__(sched)
        self.kv = FakeKVCache(sched, block_size)

    def fill(self) -> list[MicroBatch]:
        issued = super().fill()
        for batch in issued:
            self.kv.run(batch)
        return issued


def add_group(sched: Scheduler, first_id: int, prompt_len: int, n: int, max_tokens: int) -> list:
    prompt = [first_id * 100_000 + i for i in range(prompt_len)]
    params = [
        RequestParams(max_tokens=max_tokens, sampling=SamplingParams(seed=i)) for i in range(n)
    ]
    return sched.add_request_group(list(range(first_id, first_id + n)), prompt, params, 0.0)


@pytest.mark.parametrize("prompt_len", [1, 16, 17, 40, 48])
def test_the_prompt_is_computed_once_and_every_sequence_gets_its_own_tokens(
    prompt_len: int,
) -> None:
    sched = create_scheduler(budget_tokens=32)
    pipe = KVPipeline(sched)
    seqs = add_group(sched, 1, prompt_len, n=4, max_tokens=20)
    pipe.run_to_completion()
    assert all(len(s.output_token_ids) == 20 for s in seqs)
    # Each follower's first token is its own (the fake model's token depends on the sequence).
    assert len({s.output_token_ids[0] for s in seqs}) == 4
    # The prompt once, then one token per follower (its last prompt position), then decodes.
    decodes = 4 * 19
    assert pipe.kv.tokens_computed == prompt_len + 3 + decodes


def test_followers_share_the_full_blocks_and_copy_the_partial_one() -> None:
    sched = create_scheduler(budget_tokens=64)
    pipe = KVPipeline(sched)
    leader, *followers = add_group(sched, 1, 40, n=3, max_tokens=5)  # blocks of 16: 2 full
    (first,) = pipe.fill()  # the whole prompt in one micro-batch; the fork right after it
    assert first.block_copies == [] and {c.seq_id for c in first.chunks} == {leader.seq_id}
    pipe.complete_oldest()
    (second,) = pipe.fill()  # the copies, before the followers' first tokens
    assert [f.block_ids[:2] for f in followers] == [leader.block_ids[:2]] * 2
    assert second.block_copies == [(leader.block_ids[2], f.block_ids[2]) for f in followers]
    assert len({leader.block_ids[2], *(f.block_ids[2] for f in followers)}) == 3
    blocks_in_use = sched.block_manager.num_blocks - sched.block_manager.num_free
    assert blocks_in_use == 3 + 2  # 2 shared + the leader's partial one + 2 copies
    sched.check_invariants()
    pipe.run_to_completion()
    assert sched.block_manager.num_free == sched.block_manager.num_blocks


def test_a_prompt_ending_at_a_block_start_needs_no_copy() -> None:
    sched = create_scheduler(budget_tokens=64)
    pipe = KVPipeline(sched)
    leader, follower = add_group(sched, 1, 33, n=2, max_tokens=3)  # position 32 starts block 2
    pipe.fill()
    pipe.complete_oldest()
    (second,) = pipe.fill()
    assert second.block_copies == []
    assert follower.block_ids[:2] == leader.block_ids[:2]
    pipe.run_to_completion()


def test_with_a_chunked_prompt_and_pp2_the_fork_waits_for_the_last_chunk() -> None:
    sched = create_scheduler(budget_tokens=16, pipeline_depth=2, pipeline_prefill_chunks=True)
    pipe = KVPipeline(sched)
    seqs = add_group(sched, 1, 70, n=3, max_tokens=8)
    pipe.run_to_completion()
    assert all(len(s.output_token_ids) == 8 for s in seqs)
    assert pipe.kv.tokens_computed == 70 + 2 + 3 * 7


def test_aborting_the_leader_before_its_prompt_is_done_queues_the_others_alone() -> None:
    sched = create_scheduler(budget_tokens=16)
    pipe = KVPipeline(sched)
    leader, *followers = add_group(sched, 1, 50, n=3, max_tokens=4)
    pipe.fill()
    sched.abort(leader.seq_id)
    assert list(sched.waiting) == followers
    sched.check_invariants()
    pipe.run_to_completion()
    assert all(len(f.output_token_ids) == 4 for f in followers)


def test_aborting_a_waiting_follower_leaves_the_others() -> None:
    sched = create_scheduler(budget_tokens=64)
    pipe = KVPipeline(sched)
    _, f1, f2 = add_group(sched, 1, 20, n=3, max_tokens=4)
    assert sched.abort(f1.seq_id) is f1
    sched.check_invariants()
    pipe.run_to_completion()
    assert len(f2.output_token_ids) == 4 and f1.output_token_ids == []


@pytest.mark.parametrize(("prefix_caching", "recomputed"), [(False, 20), (True, 4)])
def test_followers_without_room_compute_their_prompt_alone(
    prefix_caching: bool, recomputed: int
) -> None:
    sched = create_scheduler(budget_tokens=64, max_num_seqs=2, prefix_caching=prefix_caching)
    pipe = KVPipeline(sched)
    seqs = add_group(sched, 1, 20, n=3, max_tokens=4)
    pipe.run_to_completion()
    assert all(len(s.output_token_ids) == 4 for s in seqs)
    # The third computes the prompt alone: all of it, or what follows its cached full block.
    assert pipe.kv.tokens_computed == 20 + 1 + recomputed + 3 * 3


def test_a_pipeline_reset_after_the_fork_recomputes_each_alone() -> None:
    sched = create_scheduler(budget_tokens=64, pipeline_depth=2)
    pipe = KVPipeline(sched)
    seqs = add_group(sched, 1, 40, n=3, max_tokens=6)
    pipe.fill()
    pipe.complete_oldest()
    pipe.fill()  # the followers' first tokens (and their copies) in flight
    sched.reset_inflight()
    pipe.inflight.clear()
    pipe.kv = FakeKVCache(sched, 16)  # new workers: nothing cached
    sched.check_invariants()
    pipe.run_to_completion()
    assert all(len(s.output_token_ids) == 6 for s in seqs)


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.integers(1, 70), st.integers(1, 4), st.integers(1, 12)),
        min_size=1,
        max_size=6,
    ),
    num_blocks=st.integers(12, 60),
    pp=st.integers(1, 2),
    budget=st.sampled_from([8, 16, 64]),
    aborts=st.lists(st.integers(1, 40), max_size=3),
)
def test_any_mix_keeps_every_kv_right_and_frees_every_block(
    groups: list[tuple[int, int, int]],
    num_blocks: int,
    pp: int,
    budget: int,
    aborts: list[int],
) -> None:
    sched = create_scheduler(
        budget_tokens=budget,
        pipeline_depth=pp,
        num_blocks=num_blocks,
        max_num_seqs=6,
        max_model_len=200,
    )
    pipe = KVPipeline(sched)
    seq_id = 1
    all_seqs = []
    for prompt_len, n, max_tokens in groups:
        if (prompt_len + max_tokens + 15) // 16 > num_blocks:
            continue
        all_seqs += add_group(sched, seq_id, prompt_len, n, max_tokens)
        seq_id += n
    for step in range(10_000):
        pipe.fill()
        if step in aborts and sched.has_unfinished:
            sched.abort(min(s.seq_id for s in all_seqs if sched.get(s.seq_id)))
        if not pipe.inflight:
            assert not sched.has_unfinished, "stuck"
            break
        pipe.complete_oldest()
        sched.check_invariants()
    assert sched.block_manager.num_free == num_blocks
