"""Pipeline awareness: micro-batches in flight, decodes waiting for tokens, chunks following."""

from __future__ import annotations

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
    sched = create_scheduler(budget_tokens=64, pipeline_depth=2)
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
    sched = create_scheduler(budget_tokens=64, pipeline_depth=8, chunk_schedule=((128, 32),))
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
