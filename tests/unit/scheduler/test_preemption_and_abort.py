"""KV memory running out (preemption by recompute), aborts in every state, stop tokens."""

from __future__ import annotations

from controller.scheduler import FinishReason, RequestParams, SequenceStatus
from tests.unit.scheduler.factories import (
    FakePipeline,
    add_request,
    chunk_map,
    create_scheduler,
    token_for,
)


def test_latest_arrival_is_preempted_and_recomputed_with_its_outputs() -> None:
    # 4 blocks of 4 tokens: two sequences of 6 prompt tokens hold 2 blocks each; the first decode
    # that crosses into a third block must evict the later arrival.
    sched = create_scheduler(budget_tokens=32, num_blocks=4, block_size=4)
    early = add_request(sched, 1, prompt_len=6, max_tokens=6, now=0.0)
    late = add_request(sched, 2, prompt_len=6, max_tokens=6, now=1.0)
    pipe = FakePipeline(sched)
    while late.num_preemptions == 0:
        pipe.fill()
        pipe.complete_oldest()
        sched.check_invariants()
    assert early.num_preemptions == 0 and sched.num_preemptions == 1
    assert late.status is SequenceStatus.WAITING and late.block_ids == []
    outputs_before = list(late.output_token_ids)
    # Preempted while the last micro-batch was built: that batch tells the workers to drop it.
    batch = pipe.history[-1]
    assert 2 in batch.finished_seq_ids and 2 not in chunk_map(batch)
    pipe.run_to_completion()
    assert early.finish_reason is FinishReason.LENGTH and late.finish_reason is FinishReason.LENGTH
    assert late.output_token_ids[: len(outputs_before)] == outputs_before
    assert len(late.output_token_ids) == 6


def test_recompute_covers_prompt_and_known_outputs_in_one_go() -> None:
    # Without the prefix cache (with it, the recompute starts past the blocks still cached).
    sched = create_scheduler(budget_tokens=32, num_blocks=4, block_size=4, prefix_caching=False)
    add_request(sched, 1, prompt_len=6, max_tokens=6, now=0.0)
    late = add_request(sched, 2, prompt_len=6, max_tokens=6, now=1.0)
    pipe = FakePipeline(sched)
    while late.num_preemptions == 0:
        pipe.fill()
        pipe.complete_oldest()
    known = late.num_tokens
    while True:
        (batch,) = pipe.fill()
        pipe.complete_oldest()
        if 2 in chunk_map(batch):
            break
    assert chunk_map(batch)[2] == (0, known)
    chunk = next(c for c in batch.chunks if c.seq_id == 2)
    assert chunk.sampling is not None  # workers rebuild the sequence's state
    assert chunk.token_ids == late.prompt_token_ids + late.output_token_ids[: known - 6]


def test_in_flight_sequences_are_never_preempted() -> None:
    sched = create_scheduler(budget_tokens=32, num_blocks=6, block_size=4, pipeline_depth=3)
    for seq_id in range(4):
        add_request(sched, seq_id, prompt_len=6, max_tokens=8, now=float(seq_id))
    pipe = FakePipeline(sched)
    for _ in range(400):
        inflight_before = {c.seq_id for b in pipe.inflight for c in b.chunks}
        for batch in pipe.fill():
            preempted = {i for i in batch.finished_seq_ids if sched.get(i) is not None}
            assert not preempted & inflight_before, "preempted a sequence still in the pipeline"
            inflight_before |= {c.seq_id for c in batch.chunks}
        if not pipe.inflight:
            break
        pipe.complete_oldest()
        sched.check_invariants()
    assert sched.num_preemptions > 0 and not sched.has_unfinished


def test_abort_waiting_running_and_in_flight_frees_every_block() -> None:
    sched = create_scheduler(budget_tokens=16, pipeline_depth=2, num_blocks=64, block_size=4)
    add_request(sched, 1, prompt_len=40, max_tokens=8)
    add_request(sched, 2, prompt_len=4, max_tokens=8)
    add_request(sched, 3, prompt_len=4, max_tokens=8)
    pipe = FakePipeline(sched)
    pipe.fill()  # seq 1 is in flight, 2 and 3 wait behind it
    assert sched.abort(3) is not None  # waiting
    assert sched.abort(1) is not None  # in flight
    assert sched.abort(99) is None
    while pipe.inflight:
        pipe.complete_oldest()  # results for the aborted sequence are ignored
    pipe.run_to_completion()
    seq2 = sched.get(2)
    assert seq2 is None  # finished normally
    assert sched.block_manager.num_free == 64
    sched.check_invariants()


def test_stop_token_finishes_with_stop_reason() -> None:
    sched = create_scheduler()
    stop = token_for(5, 4)  # the fake model's token after position 4 (the first decode)
    seq = sched.add_request(
        5, [1, 2, 3, 4], RequestParams(max_tokens=10, stop_token_ids=frozenset({stop})), 0.0
    )
    FakePipeline(sched).run_to_completion()
    assert seq.finish_reason is FinishReason.STOP
    assert seq.output_token_ids == [token_for(5, 3), stop]  # the stop token is kept


def test_engine_can_finish_a_sequence_for_a_stop_string() -> None:
    sched = create_scheduler()
    add_request(sched, 1, prompt_len=4, max_tokens=10)
    pipe = FakePipeline(sched)
    pipe.fill()
    pipe.complete_oldest()
    seq = sched.abort(1, FinishReason.STOP)
    assert seq is not None and seq.finish_reason is FinishReason.STOP
    assert sched.take_finished_seq_ids() == [1]
    assert sched.block_manager.num_free == sched.block_manager.num_blocks


def test_max_num_seqs_limits_admission() -> None:
    sched = create_scheduler(max_num_seqs=2)
    for seq_id in range(4):
        add_request(sched, seq_id, prompt_len=4, max_tokens=3)
    (batch,) = FakePipeline(sched).fill()
    assert set(chunk_map(batch)) == {0, 1} and sched.num_waiting == 2


def test_watermark_keeps_blocks_free_for_running_decodes() -> None:
    sched = create_scheduler(num_blocks=10, block_size=4, watermark=0.2)  # 2 blocks reserved
    add_request(sched, 1, prompt_len=16, max_tokens=4)  # 4 blocks
    add_request(sched, 2, prompt_len=16, max_tokens=4)  # 4 more would leave 2: allowed
    add_request(sched, 3, prompt_len=4, max_tokens=4)  # 1 more would leave 1 < 2: waits
    (batch,) = FakePipeline(sched).fill()
    assert set(chunk_map(batch)) == {1, 2}
