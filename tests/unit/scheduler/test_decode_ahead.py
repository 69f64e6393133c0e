"""Decodes that go ahead of their input token (SchedulerConfig.decode_ahead): the micro-batches
they make, the token after a stop token dropped, and prefix names kept to known tokens."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.scheduler import ConfigError, FinishReason, MicroBatch, RequestParams
from tests.unit.scheduler.factories import (
    FakePipeline,
    add_request,
    chunk_map,
    create_scheduler,
    token_for,
)


def assert_each_sequence_once(batch: MicroBatch) -> None:
    ids = [c.seq_id for c in batch.chunks]
    ids += list(batch.decodes.seq_ids) if batch.decodes is not None else []
    assert len(ids) == len(set(ids)), (batch.batch_id, chunk_map(batch))


def ahead_ids(batch: object) -> list[int]:
    return [c.seq_id for c in batch.chunks if c.ahead]  # type: ignore[attr-defined]


@pytest.mark.parametrize("vector_decodes_from", [1, 1 << 30], ids=["columns", "chunks"])
def test_each_decode_goes_while_the_one_before_is_in_flight(vector_decodes_from: int) -> None:
    sched = create_scheduler(decode_ahead=True, vector_decodes_from=vector_decodes_from)
    add_request(sched, 1, prompt_len=5, max_tokens=4)
    pipe = FakePipeline(sched)
    # The prompt, and its first decode, fed the token the prompt yields.
    prompt, first = pipe.fill()
    assert chunk_map(prompt) == {1: (0, 5)} and not ahead_ids(prompt)
    assert chunk_map(first) == {1: (5, 1)} and ahead_ids(first) == [1]
    assert first.chunks[0].token_ids == []  # the worker has it, the controller not yet
    assert pipe.fill() == []  # two in flight at PP = 1
    pipe.complete_oldest()
    [second] = pipe.fill()
    assert chunk_map(second) == {1: (6, 1)} and ahead_ids(second) == [1]
    pipe.complete_oldest()
    [third] = pipe.fill()
    assert chunk_map(third) == {1: (7, 1)} and ahead_ids(third) == [1]
    pipe.complete_oldest()
    assert pipe.fill() == []  # the token in flight is its last (max_tokens 4): none goes past it
    pipe.complete_oldest()
    seq = sched.get(1)
    assert seq is None
    assert sched.block_manager.num_free == sched.block_manager.num_blocks
    sched.check_invariants()


def test_the_token_after_a_stop_token_is_dropped() -> None:
    sched = create_scheduler(decode_ahead=True)
    stop = token_for(1, 5)  # the second output token (it follows position 5)
    seq = sched.add_request(
        1, list(range(5)), RequestParams(max_tokens=10, stop_token_ids=frozenset({stop})), 0.0
    )
    add_request(sched, 2, prompt_len=3, max_tokens=10)
    pipe = FakePipeline(sched)
    pipe.fill()
    pipe.complete_oldest()  # first tokens
    pipe.fill()
    pipe.complete_oldest()  # second tokens: 1 stops, with a decode ahead in flight
    assert seq.finish_reason is FinishReason.STOP and seq.output_token_ids[-1] == stop
    assert 1 in ahead_ids(pipe.inflight[0])
    [after] = pipe.fill()
    assert 1 in after.finished_seq_ids  # the workers forget it once the ahead decode ran
    assert [s.seq_id for s in pipe.complete_oldest()] == [2]  # 1's token is not applied
    assert len(seq.output_token_ids) == 2
    sched.check_invariants()
    pipe.run_to_completion()
    assert sched.block_manager.num_free == sched.block_manager.num_blocks


def test_an_abort_with_a_decode_ahead_names_only_known_tokens() -> None:
    """A decode ahead computes a position whose token the scheduler does not have: aborted
    then (a stop string, a cancel), the sequence's blocks are named up to its known tokens."""
    sched = create_scheduler(decode_ahead=True, block_size=4)
    seq = add_request(sched, 1, prompt_len=6, max_tokens=10)
    pipe = FakePipeline(sched)
    pipe.fill()
    pipe.complete_oldest()  # 7 tokens known, 6 computed
    pipe.fill()  # positions 6 and 7 (ahead): computed reaches 8, a full second block
    assert seq.num_computed_tokens == 8 and seq.num_tokens == 7
    first, second = seq.block_ids
    sched.abort(1)
    # The second block holds position 7, whose token is still in flight: it stays unnamed.
    bm = sched.block_manager
    assert bm.hash_of(first) is not None and bm.hash_of(second) is None
    assert len(seq.block_hashes) == 1
    while pipe.inflight:
        assert pipe.complete_oldest() == []
    sched.check_invariants()


@pytest.mark.parametrize("policy", ["sarathi", "request_level", "orca", "vllm", "chunked_only"])
def test_a_sequence_goes_once_a_micro_batch_under_every_policy(policy: str) -> None:
    """n = 3 choices: the two that fork from the first compute the prompt's last token in a
    micro-batch of their own. request_level adds that chunk before decodes, and the first
    decode ahead once went into the same micro-batch behind it (the worker refused the plan:
    "sequence 2 appears twice", and the pipeline was rebuilt for every such request)."""
    sched = create_scheduler(policy=policy, decode_ahead=True, block_size=4)
    params = RequestParams(max_tokens=5)
    sched.add_request_group([1, 2, 3], list(range(10)), [params] * 3, 0.0)
    pipe = FakePipeline(sched)
    done = 0
    for _ in range(50):
        for batch in pipe.fill():
            assert_each_sequence_once(batch)
            done += 1
        if not pipe.inflight:
            break
        pipe.complete_oldest()
    assert done > 3 and all(sched.get(i) is None for i in (1, 2, 3))  # all three finished
    sched.check_invariants()


def run_groups(
    policy: str, groups: list[tuple[int, int, int]], num_blocks: int, ahead: bool
) -> dict[int, list[int]]:
    """Requests of n choices each, (prompt length, max tokens, n), all at once, through the
    fake pipeline; checks that no sequence goes twice into a micro-batch and returns each
    sequence's output tokens."""
    sched = create_scheduler(
        policy=policy, decode_ahead=ahead, block_size=4, num_blocks=num_blocks, max_num_seqs=8
    )
    seqs = []
    for index, (prompt_len, max_tokens, n) in enumerate(groups):
        ids = [index * 10 + k for k in range(n)]
        prompt = [index * 100_000 + i for i in range(prompt_len)]
        seqs += sched.add_request_group(ids, prompt, [RequestParams(max_tokens=max_tokens)] * n, 0)
    pipe = FakePipeline(sched)
    for _ in range(10_000):
        for batch in pipe.fill():
            assert_each_sequence_once(batch)
        if not pipe.inflight:
            break
        pipe.complete_oldest()
        sched.check_invariants()
    assert not sched.has_unfinished
    assert sched.block_manager.num_free == sched.block_manager.num_blocks
    return {seq.seq_id: seq.output_token_ids for seq in seqs}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["sarathi", "request_level", "orca", "vllm", "chunked_only"]),
    groups=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(1, 3)),
        min_size=1,
        max_size=5,
    ),
    num_blocks=st.sampled_from([24, 400]),
)
def test_choices_of_one_prompt_get_the_tokens_they_get_without_going_ahead(
    policy: str, groups: list[tuple[int, int, int]], num_blocks: int
) -> None:
    """n > 1 (forks of one prompt) under every policy, KV blocks short or not: each sequence
    once a micro-batch, and every output the one the plain order gives."""
    ahead = run_groups(policy, groups, num_blocks, True)
    assert ahead == run_groups(policy, groups, num_blocks, False)


def test_decodes_ahead_need_one_stage() -> None:
    with pytest.raises(ConfigError, match="decode_ahead"):
        create_scheduler(decode_ahead=True, pipeline_depth=2)
