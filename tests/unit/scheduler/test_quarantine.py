"""Quarantine (quarantine.py): a request whose step fails on a worker every time ends with an
error after its trial alone, and everyone else's outputs are those of a run without it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controller.scheduler import FinishReason, MicroBatch, RequestParams, Scheduler, Sequence
from controller.scheduler.quarantine import MAX_STEP_FAULTS
from tests.unit.scheduler.factories import FakePipeline, add_request, create_scheduler

Fails = Callable[[MicroBatch], bool]


@dataclass
class FaultyPipeline(FakePipeline):
    """A fake pipeline whose step fails for the micro-batches `fails` picks: the scheduler hears
    of it (on_step_fault), then the pipeline is rebuilt (reset_inflight) and everything in flight
    is lost, as the engine and the executor do it. Checks that a suspect on trial runs alone."""

    fails: Fails = lambda batch: False
    num_faults: int = 0
    errored: list[Sequence] = field(default_factory=list)
    trial_batches: int = 0

    def fill(self) -> list[MicroBatch]:
        issued = super().fill()
        trial = self.sched.quarantine.on_trial
        for batch in issued:
            if trial is not None:
                self.trial_batches += 1
                assert {c.seq_id for c in batch.chunks} == {trial.seq_id}, batch
        return issued

    def complete_oldest(self) -> list[Sequence]:
        batch = self.inflight[0]
        if not self.fails(batch):
            return super().complete_oldest()
        self.num_faults += 1
        self.errored += self.sched.on_step_fault(batch.batch_id)
        self.sched.reset_inflight()
        self.inflight.clear()
        self.now += 1.0
        return []


def holds(seq_id: int, position: int = -1) -> Fails:
    """Fails every micro-batch with a chunk of seq_id (covering position, when given)."""

    def fails(batch: MicroBatch) -> bool:
        return any(
            c.seq_id == seq_id
            and (position < 0 or c.first_position <= position < c.first_position + c.num_tokens)
            for c in batch.chunks
        )

    return fails


def outputs_alone(make: Callable[[], Scheduler], lengths: list[tuple[int, int]]) -> dict:
    sched = make()
    seqs = [add_request(sched, i, p, m, now=float(i)) for i, (p, m) in enumerate(lengths)]
    FakePipeline(sched).run_to_completion()
    return {s.seq_id: s.output_token_ids for s in seqs}


LENGTHS = [(20, 6), (35, 5), (9, 8), (50, 4)]


@pytest.mark.parametrize(("depth", "ahead"), [(1, False), (1, True), (2, False)])
def test_a_request_that_always_fails_ends_with_an_error_and_the_rest_run_as_without_it(
    depth: int, ahead: bool
) -> None:
    def make() -> Scheduler:
        return create_scheduler(budget_tokens=16, pipeline_depth=depth, decode_ahead=ahead)

    expected = outputs_alone(make, LENGTHS)
    sched = make()
    seqs = [add_request(sched, i, p, m, now=float(i)) for i, (p, m) in enumerate(LENGTHS)]
    pipe = FaultyPipeline(sched, fails=holds(2))
    pipe.run_to_completion()

    bad = seqs[2]
    assert pipe.errored == [bad] and bad.finish_reason is FinishReason.ERROR
    assert pipe.num_faults == 2  # once with company, once alone on trial
    assert pipe.trial_batches > 0
    for seq in seqs:
        if seq is not bad:
            assert seq.finish_reason is FinishReason.LENGTH
            assert seq.output_token_ids == expected[seq.seq_id]
    assert not sched.quarantine.active
    assert sched.block_manager.num_free == sched.block_manager.num_blocks


def test_a_fault_that_does_not_recur_clears_every_suspect() -> None:
    def make() -> Scheduler:
        return create_scheduler(budget_tokens=16)

    expected = outputs_alone(make, LENGTHS)
    sched = make()
    seqs = [add_request(sched, i, p, m, now=float(i)) for i, (p, m) in enumerate(LENGTHS)]
    once = [True]

    def fails_once(batch: MicroBatch) -> bool:
        if once[0] and len({c.seq_id for c in batch.chunks}) > 1:
            once[0] = False
            return True
        return False

    pipe = FaultyPipeline(sched, fails=fails_once)
    pipe.run_to_completion()
    assert pipe.num_faults == 1 and pipe.errored == [] and pipe.trial_batches > 0
    assert {s.seq_id: s.output_token_ids for s in seqs} == expected
    assert [s.num_step_faults > 0 for s in seqs].count(True) >= 2


def test_a_sequence_alone_fails_only_on_its_second_fault() -> None:
    sched = create_scheduler(budget_tokens=16)
    seq = add_request(sched, 1, prompt_len=10, max_tokens=4)
    pipe = FaultyPipeline(sched, fails=holds(1, position=11))  # its second decode
    pipe.run_to_completion()
    assert pipe.num_faults == 2 and seq.finish_reason is FinishReason.ERROR
    assert len(seq.output_token_ids) == 2  # what it had streamed before it failed is kept


def test_a_fault_that_needs_company_ends_its_sequences_after_the_bound() -> None:
    """Two sequences fail only together: each passes its trial alone, so they fail together
    again, up to MAX_STEP_FAULTS; then both end with an error. A third, there for fewer of those
    faults, runs on as without them."""

    def make() -> Scheduler:
        return create_scheduler(budget_tokens=64)

    lengths = [(6, 30), (7, 30), (8, 20)]
    expected = outputs_alone(make, lengths)
    sched = make()
    seqs = [add_request(sched, i, p, m, now=float(i)) for i, (p, m) in enumerate(lengths[:2])]

    def together(batch: MicroBatch) -> bool:
        return {0, 1} <= {c.seq_id for c in batch.chunks}

    pipe = FaultyPipeline(sched, fails=together)
    while not pipe.num_faults:
        pipe.fill()
        pipe.complete_oldest()
    seqs.append(add_request(sched, 2, *lengths[2], now=2.0))  # arrives after the first fault
    pipe.run_to_completion()
    assert pipe.num_faults == MAX_STEP_FAULTS
    assert {s.seq_id for s in pipe.errored} == {0, 1}
    assert seqs[2].num_step_faults == MAX_STEP_FAULTS - 1
    assert seqs[2].finish_reason is FinishReason.LENGTH
    assert seqs[2].output_token_ids == expected[2]


def test_a_fault_reported_after_the_requeue_still_names_its_sequences() -> None:
    """The executor may see the worker gone (and requeue) before its fault report is read."""
    sched = create_scheduler(budget_tokens=16)
    seqs = [add_request(sched, i, 12, 3, now=float(i)) for i in range(2)]
    pipe = FakePipeline(sched)
    [batch] = pipe.fill()
    sched.reset_inflight()
    assert sched.on_step_fault(batch.batch_id) == []
    assert list(sched.quarantine.suspects) == [s.seq_id for s in seqs]
    assert sched.on_step_fault(batch.batch_id + 100) == []  # unknown: nothing changes
    assert all(s.num_step_faults == 1 for s in seqs)


def test_new_requests_wait_for_the_trials_and_aborted_suspects_are_let_go() -> None:
    sched = create_scheduler(budget_tokens=16)
    seqs = [add_request(sched, i, 12, 3, now=float(i)) for i in range(3)]
    pipe = FakePipeline(sched)
    [batch] = pipe.fill()
    assert sched.on_step_fault(batch.batch_id) == []
    sched.reset_inflight()
    pipe.inflight.clear()
    late = add_request(sched, 9, 5, 2, now=5.0)
    sched.abort(seqs[0].seq_id)
    [trial] = pipe.fill()
    assert {c.seq_id for c in trial.chunks} == {seqs[1].seq_id}  # 0 is gone: 1 is next
    assert late.first_scheduled_time is None
    pipe.run_to_completion()
    assert late.finish_reason is FinishReason.LENGTH
    assert seqs[1].finish_reason is seqs[2].finish_reason is FinishReason.LENGTH


def test_one_micro_batch_reported_twice_counts_once() -> None:
    """Each TP rank of a stage runs the same step and reports the same fault, before or after
    the requeue: one fault, so a lone request gets its trial rather than an error."""
    sched = create_scheduler(budget_tokens=16)
    seq = add_request(sched, 1, 12, 3)
    [batch] = FakePipeline(sched).fill()
    assert sched.on_step_fault(batch.batch_id) == []
    assert sched.on_step_fault(batch.batch_id) == []
    sched.reset_inflight()
    assert sched.on_step_fault(batch.batch_id) == []
    assert seq.num_step_faults == 1 and seq.finish_reason is None


def test_a_sequence_is_not_alone_beside_one_aborted_since() -> None:
    """The fault may be the aborted one's: the survivor of a failed micro-batch of two is a
    suspect again, not convicted, though it had failed before."""
    sched = create_scheduler(budget_tokens=16)
    first, second = add_request(sched, 1, 6, 3), add_request(sched, 2, 6, 3)
    pipe = FakePipeline(sched)
    [batch] = pipe.fill()
    first.num_step_faults = 1  # a fault before
    sched.abort(second.seq_id)
    assert sched.on_step_fault(batch.batch_id) == []
    assert first.num_step_faults == 2 and list(sched.quarantine.suspects) == [1]


def test_an_n_2_leader_on_trial_does_not_fork_into_it() -> None:
    """The choices waiting for a suspect leader's prompt compute it themselves after its
    trial: forked from it, they would run in the trial, which stays alone."""
    sched = create_scheduler(budget_tokens=16)
    prompt = [900_000 + i for i in range(20)]
    leader, follower = sched.add_request_group(
        [5, 6], prompt, [RequestParams(max_tokens=4)] * 2, 0.0
    )
    pipe = FaultyPipeline(sched)
    [first] = pipe.fill()  # the leader's first chunk: its prompt is not whole yet
    assert sched.on_step_fault(first.batch_id) == []
    sched.reset_inflight()
    pipe.inflight.clear()
    # A trial that lasts past the leader's whole prompt (a fault in a prompt's middle chunk
    # with more chunks built ahead at PP > 1 does the same).
    sched.quarantine.clear_at[leader.seq_id] = 22
    pipe.run_to_completion()
    assert pipe.trial_batches >= 3  # the prompt in two chunks, then a decode: all alone
    assert leader.finish_reason is follower.finish_reason is FinishReason.LENGTH


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["sarathi", "vllm", "orca", "chunked_only", "request_level"]),
    depth=st.integers(1, 3),
    ahead=st.booleans(),
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 8)), min_size=1, max_size=5),
    bad=st.integers(0, 4),
    position=st.integers(0, 47),
    num_blocks=st.sampled_from([12, 1024]),
)
# A position mid-prompt: the trial must compute it again, not pass on the prompt's length.
@example("sarathi", 1, False, [(4, 8), (30, 4)], 1, 20, 1024)
def test_any_bad_position_of_any_request_ends_only_that_request(
    policy: str,
    depth: int,
    ahead: bool,
    lengths: list[tuple[int, int]],
    bad: int,
    position: int,
    num_blocks: int,
) -> None:
    """A request that fails whenever a chunk computes one given position of it: it ends with an
    error (its first fault, then its trial alone) if it ever computes that position and runs as
    without the fault otherwise; every other request's outputs are a run without it."""
    ahead = ahead and depth == 1  # decodes go ahead at PP = 1 only

    def make() -> Scheduler:
        return create_scheduler(
            policy=policy,
            budget_tokens=16,
            pipeline_depth=depth,
            decode_ahead=ahead,
            num_blocks=num_blocks,
            block_size=4,
        )

    expected = outputs_alone(make, lengths)
    sched = make()
    seqs = [add_request(sched, i, p, m, now=float(i)) for i, (p, m) in enumerate(lengths)]
    pipe = FaultyPipeline(sched, fails=holds(bad, position))
    pipe.run_to_completion()
    assert pipe.num_faults <= 2
    for seq in seqs:
        if seq.finish_reason is FinishReason.ERROR:
            assert seq.seq_id == bad
            # what it streamed before failing is what it would have streamed
            got = seq.output_token_ids
            assert got == expected[seq.seq_id][: len(got)]
        else:
            assert seq.output_token_ids == expected[seq.seq_id]
            assert seq.num_step_faults <= 1  # an innocent is charged for the first fault only
    assert not sched.quarantine.active
    assert sched.block_manager.num_free == sched.block_manager.num_blocks
