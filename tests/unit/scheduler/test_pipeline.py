"""Pipeline awareness: micro-batches in flight, decodes waiting for tokens, chunks following."""

from __future__ import annotations

import pytest

from controller.scheduler import CacheConfig, MicroBatch, Scheduler, SchedulerConfig
from controller.scheduler.sequence import RequestParams
from tests.unit.scheduler.factories import FakePipeline, add_request, chunk_map, create_scheduler


def test_one_long_prompt_fills_the_pipeline() -> None:
    sched = create_scheduler(budget_tokens=64, pipeline_depth=4)
    add_request(sched, 1, prompt_len=256, max_tokens=2)
    batches = FakePipeline(sched).fill()
    assert [chunk_map(b)[1] for b in batches] == [(0, 64), (64, 64), (128, 64), (192, 64)]
    assert [c.yields_token for b in batches for c in b.chunks] == [False, False, False, True]


def test_without_chunk_pipelining_a_prompt_waits_for_its_previous_chunk() -> None:
    sched = create_scheduler(budget_tokens=64, pipeline_depth=4, pipeline_prefill_chunks=False)
    add_request(sched, 1, prompt_len=256, max_tokens=2)
    pipe = FakePipeline(sched)
    assert len(pipe.fill()) == 1
    pipe.complete_oldest()
    assert [chunk_map(b)[1] for b in pipe.fill()] == [(64, 64)]


def test_at_most_pipeline_depth_micro_batches_in_flight() -> None:
    sched = create_scheduler(budget_tokens=16, pipeline_depth=3)
    for seq_id in range(10):
        add_request(sched, seq_id, prompt_len=40, max_tokens=2)
    pipe = FakePipeline(sched)
    assert len(pipe.fill()) == 3
    assert sched.schedule(pipe.now) is None
    pipe.complete_oldest()
    assert len(pipe.fill()) == 1


def test_decode_waits_until_its_token_is_back() -> None:
    sched = create_scheduler(budget_tokens=64, pipeline_depth=2, spread_prompts=False)
    add_request(sched, 1, prompt_len=10, max_tokens=5)
    pipe = FakePipeline(sched)
    assert len(pipe.fill()) == 1  # the second slot stays empty: nothing else can run
    pipe.complete_oldest()
    (batch,) = pipe.fill()
    assert chunk_map(batch) == {1: (10, 1)}
    assert batch.chunks[0].token_ids == [sched.get(1).output_token_ids[0]]  # type: ignore[union-attr]


def test_two_decoding_groups_alternate_to_fill_two_stages() -> None:
    sched = create_scheduler(budget_tokens=64, pipeline_depth=2, max_num_seqs=4)
    add_request(sched, 1, prompt_len=8, max_tokens=6)
    add_request(sched, 2, prompt_len=80, max_tokens=6)
    pipe = FakePipeline(sched)
    first, second = pipe.fill()
    assert set(chunk_map(first)) == {1, 2} and set(chunk_map(second)) == {2}
    pipe.complete_oldest()
    (third,) = pipe.fill()
    assert chunk_map(third) == {1: (8, 1)}  # seq 1 decodes while seq 2's last chunk is in flight


def test_chunk_schedule_shrinks_chunks_of_long_prompts() -> None:
    sched = create_scheduler(
        budget_tokens=64, pipeline_depth=8, chunk_schedule=((128, 32),), spread_prompts=False
    )  # prompts not spread: each chunk is as large as the schedule lets it be
    add_request(sched, 1, prompt_len=256, max_tokens=1)
    sizes = [chunk_map(b)[1][1] for b in FakePipeline(sched).fill()]
    assert sizes == [64, 64, 32, 32, 32, 32]


def test_finished_sequences_are_announced_to_workers_once() -> None:
    sched = create_scheduler(budget_tokens=64)
    add_request(sched, 1, prompt_len=4, max_tokens=1)
    add_request(sched, 2, prompt_len=4, max_tokens=3)
    pipe = FakePipeline(sched)
    pipe.fill()
    pipe.complete_oldest()  # seq 1 finished with its only token
    (batch,) = pipe.fill()
    assert batch.finished_seq_ids == [1]
    pipe.complete_oldest()
    (batch,) = pipe.fill()
    assert batch.finished_seq_ids == []


def test_first_chunk_carries_sampling_params_and_later_ones_do_not() -> None:
    sched = create_scheduler(budget_tokens=16, pipeline_depth=2)
    add_request(sched, 1, prompt_len=20, max_tokens=1)
    first, second = FakePipeline(sched).fill()
    assert first.chunks[0].sampling is not None and second.chunks[0].sampling is None
    assert first.chunks[0].new_block_ids == (0, 1) and second.chunks[0].new_block_ids == ()


def _decodes(batch: MicroBatch, seq_ids: range) -> set[int]:
    return {c.seq_id for c in batch.chunks if c.seq_id in seq_ids and c.num_tokens == 1}


@pytest.mark.parametrize("spread_decodes", [True, False])
def test_decodes_that_finish_their_prompts_together_split_over_the_pipeline(
    spread_decodes: bool,
) -> None:
    """PP = 2: 64 prompts finish in one micro-batch while a long prompt's chunks fill the other
    slot. Spread, their decodes go 32 and 32 from the first round on; not spread (the scheduler
    before), all 64 travel in one micro-batch of every two, for as long as they decode."""
    short = range(64)
    sched = create_scheduler(
        budget_tokens=256, max_num_seqs=65, pipeline_depth=2, spread_decodes=spread_decodes
    )
    for seq_id in short:
        add_request(sched, seq_id, prompt_len=4, max_tokens=12)
    add_request(sched, 100, prompt_len=4000, max_tokens=1)
    pipe = FakePipeline(sched)
    first, second = pipe.fill()
    assert set(chunk_map(first)) == set(short) and set(chunk_map(second)) == {100}
    lanes = []
    for _ in range(8):  # four rounds of two micro-batches
        pipe.complete_oldest()
        (batch,) = pipe.fill()
        assert batch.num_tokens == 256  # the long prompt fills what the decodes leave
        lanes.append(_decodes(batch, short))
    if not spread_decodes:
        assert [len(lane) for lane in lanes] == [64, 0] * 4
        return
    assert [len(lane) for lane in lanes] == [32] * 8
    assert lanes[0] | lanes[1] == set(short)
    assert lanes[0::2] == [lanes[0]] * 4 and lanes[1::2] == [lanes[1]] * 4  # lanes stay put


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_decodes_alone_fill_every_pipeline_slot(pp: int) -> None:
    """With nothing but decodes (PP in 2..4), 64 decoding sequences that finished their prompts
    together fill all PP slots within the first round, 64 / PP each (within 1), and every one
    of them decodes once per round of PP micro-batches after that."""
    short = range(64)
    sched = create_scheduler(
        budget_tokens=256, max_num_seqs=64, pipeline_depth=pp, spread_prompts=False
    )  # the prompts in one micro-batch, so that all 64 start decoding together
    for seq_id in short:
        add_request(sched, seq_id, prompt_len=4, max_tokens=12)
    pipe = FakePipeline(sched)
    assert len(pipe.fill()) == 1  # the 64 prompts; nothing else can run
    pipe.complete_oldest()
    first_round = pipe.fill()
    q, r = divmod(64, pp)
    assert [len(_decodes(b, short)) for b in first_round] == [q + 1] * r + [q] * (pp - r)
    for _ in range(3 * pp):
        pipe.complete_oldest()
        (batch,) = pipe.fill()
        assert _decodes(batch, short) == _decodes(pipe.history[-1 - pp], short)


@pytest.mark.parametrize(
    ("prompt_len", "chunks"),
    [(20, [20]), (40, [40]), (64, [32, 32]), (65, [32, 33]), (200, [64, 64, 64, 8])],
)
def test_served_defaults_share_a_prompt_in_tiles(prompt_len: int, chunks: list[int]) -> None:
    """As served (SchedulerConfig's defaults: prompts spread, tiles of 32) at PP=2 and budget
    64: a prompt is split only into parts of a tile or more (a sliver would pay a step's fixed
    cost for nothing), so 40 tokens go whole and 65 as 32 and 33; a long one goes in
    budget-sized chunks until its last."""
    config = SchedulerConfig(budget_tokens=64, max_num_seqs=64, pipeline_depth=2)
    sched = Scheduler(config, CacheConfig(block_size=16, num_blocks=64))
    assert sched.spread_prompts
    add_request(sched, 1, prompt_len=prompt_len, max_tokens=2)
    pipe = FakePipeline(sched)
    taken: list[int] = []
    while sum(taken) < prompt_len:
        for batch in pipe.fill():
            taken.append(chunk_map(batch)[1][1])
        pipe.complete_oldest()
    assert taken == chunks


@pytest.mark.parametrize("spread_prompts", [True, False])
def test_a_lone_prompt_is_shared_out_over_the_pipeline(spread_prompts: bool) -> None:
    """PP = 2, decodes running and one 256-token prompt arriving: spread, it goes as two chunks
    of 128 in two consecutive micro-batches (equal work for both pipeline slots); not spread,
    one micro-batch takes all its budget leaves beside its two decodes (254) and the next
    carries the last 2 tokens and its decodes."""
    sched = create_scheduler(
        budget_tokens=256, tile_tokens=32, max_num_seqs=8, pipeline_depth=2,
        spread_prompts=spread_prompts,
    )  # fmt: skip
    for seq_id in range(4):
        add_request(sched, seq_id, prompt_len=4, max_tokens=20)
    pipe = FakePipeline(sched)
    pipe.fill()
    pipe.complete_oldest()
    pipe.fill()  # the four decode now, two a micro-batch
    add_request(sched, 9, prompt_len=256, max_tokens=2)
    pipe.complete_oldest()
    (first,) = pipe.fill()
    pipe.complete_oldest()
    (second,) = pipe.fill()
    prompt_tokens = [sum(c.num_tokens for c in b.chunks if c.seq_id == 9) for b in (first, second)]
    assert prompt_tokens == ([128, 128] if spread_prompts else [254, 2])


@pytest.mark.parametrize("spread_prompts", [True, False])
def test_a_prompt_past_a_cached_prefix_is_shared_out_by_its_new_tokens(
    spread_prompts: bool,
) -> None:
    """A prompt whose first 256 tokens are cached brings 64 new ones: spread, they go as two
    chunks of 32 (a tile each), not as one full micro-batch and a tail. The 256 cached tokens
    are no work, so they must not count toward filling the pipeline."""
    sched = create_scheduler(
        budget_tokens=64, tile_tokens=32, max_num_seqs=8, pipeline_depth=2,
        spread_prompts=spread_prompts,
    )  # fmt: skip
    prefix = [5_000_000 + i for i in range(256)]
    params = RequestParams(max_tokens=40)
    sched.add_request(0, [*prefix, 1, 2, 3, 4], params, 0.0)
    sched.add_request(1, [9, 8, 7, 6], params, 0.0)
    pipe = FakePipeline(sched)
    pipe.fill()
    for _ in range(6):  # the prefix in four chunks, then both decode, one a micro-batch
        pipe.complete_oldest()
        pipe.fill()
    sched.add_request(9, [*prefix, *range(100, 164)], RequestParams(max_tokens=2), 0.0)
    built = []
    while sum(built) < 64:
        pipe.complete_oldest()
        for batch in pipe.fill():
            built.append(sum(c.num_tokens for c in batch.chunks if c.seq_id == 9))
    assert sched.prefix_cache.stats.num_cached_tokens == 256  # the prefix came from the cache
    taken = [n for n in built if n]
    assert taken == ([32, 32] if spread_prompts else [63, 1])
