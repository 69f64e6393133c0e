"""A rebuilt pipeline loses every micro-batch in flight: reset_inflight requeues for recompute."""

from __future__ import annotations

from collections import deque

from controller.scheduler import FinishReason, SequenceStatus
from tests.unit.scheduler.factories import FakePipeline, add_request, chunk_map, create_scheduler


def _undisturbed_outputs(prompt_len: int, max_tokens: int, num_seqs: int) -> dict[int, list[int]]:
    sched = create_scheduler(budget_tokens=16, pipeline_depth=2)
    seqs = [add_request(sched, i, prompt_len, max_tokens, now=float(i)) for i in range(num_seqs)]
    FakePipeline(sched).run_to_completion()
    return {s.seq_id: s.output_token_ids for s in seqs}


def test_streams_after_a_reset_equal_an_undisturbed_run() -> None:
    expected = _undisturbed_outputs(prompt_len=20, max_tokens=8, num_seqs=3)
    sched = create_scheduler(budget_tokens=16, pipeline_depth=2)
    seqs = [add_request(sched, i, 20, 8, now=float(i)) for i in range(3)]
    pipe = FakePipeline(sched)
    while sum(len(s.output_token_ids) for s in seqs) < 6:  # some tokens already streamed
        pipe.fill()
        pipe.complete_oldest()
    sent_before = {s.seq_id: list(s.output_token_ids) for s in seqs}
    pipe.fill()
    assert sched.num_inflight_batches > 0

    requeued = sched.reset_inflight()
    pipe.inflight = deque()  # the old workers' results never arrive
    sched.check_invariants()

    assert [s.seq_id for s in requeued] == [s.seq_id for s in seqs if s.block_ids == []]
    assert all(s.status is SequenceStatus.WAITING for s in seqs)
    assert sched.kv_usage == 0.0 and sched.num_inflight_batches == 0
    pipe.run_to_completion()
    for seq in seqs:
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids[: len(sent_before[seq.seq_id])] == sent_before[seq.seq_id]
        assert seq.output_token_ids == expected[seq.seq_id]


def test_first_plan_after_a_reset_recreates_worker_state_and_names_no_old_ids() -> None:
    sched = create_scheduler(budget_tokens=64, pipeline_depth=1)
    seq = add_request(sched, 1, prompt_len=5, max_tokens=4)
    pipe = FakePipeline(sched)
    pipe.fill()
    pipe.complete_oldest()
    known = seq.num_tokens
    sched.reset_inflight()
    (batch,) = pipe.fill()
    # New workers never saw sequence 1: no finished id for it, and full state in its chunk.
    assert batch.finished_seq_ids == []
    assert chunk_map(batch)[1] == (0, known)
    assert batch.chunks[0].sampling is not None


def test_waiting_prompt_tokens_count_what_the_queue_will_prefill() -> None:
    sched = create_scheduler(budget_tokens=8, max_num_seqs=1)
    add_request(sched, 1, prompt_len=5, max_tokens=2)
    add_request(sched, 2, prompt_len=7, max_tokens=2)
    assert sched.num_waiting_prompt_tokens == 12
    FakePipeline(sched).fill()
    assert sched.num_waiting_prompt_tokens == 7
