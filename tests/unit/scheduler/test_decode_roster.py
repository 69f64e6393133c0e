"""The decode roster (decoding sequences held as columns) and the decode block of a micro-batch."""

from __future__ import annotations

import numpy as np
import pytest

from controller.scheduler import FinishReason, RequestParams, Scheduler, Sequence
from controller.scheduler.batch import DecodeBlock, MicroBatch, ScheduledChunk
from controller.scheduler.batch_builder import BatchBuilder
from controller.scheduler.decode_roster import DecodeRoster
from tests.unit.scheduler.factories import (
    FakePipeline,
    add_request,
    create_scheduler,
    token_for,
)


@pytest.fixture(params=[1, 1 << 30], ids=["vector-block", "chunk-each"])
def vector_decodes_from(request: pytest.FixtureRequest) -> int:
    """Each test that takes it runs twice: decodes as one vector block, and as a chunk each."""
    return int(request.param)


def _scheduler(
    vector_decodes_from: int,
    budget_tokens: int = 64,
    max_num_seqs: int = 8,
    pipeline_depth: int = 1,
) -> Scheduler:
    return create_scheduler(
        budget_tokens=budget_tokens,
        max_num_seqs=max_num_seqs,
        pipeline_depth=pipeline_depth,
        vector_decodes_from=vector_decodes_from,
        spread_prompts=False,  # a short prompt goes in one micro-batch, not one per stage
    )


def _decoding_seq(seq_id: int, prompt_len: int = 3, stop: frozenset[int] = frozenset()) -> Sequence:
    seq = Sequence(seq_id, list(range(prompt_len)), RequestParams(8, stop_token_ids=stop), 0.0)
    seq.output_token_ids.append(100 + seq_id)
    seq.num_computed_tokens = prompt_len
    seq.block_ids = [seq_id]
    seq.last_token_time = 1.5
    return seq


def _three_decoding(vector_decodes_from: int) -> tuple[Scheduler, list[Sequence], FakePipeline]:
    """Sequences 0, 1, 2 (4-token prompts, 10 tokens each), all decoding, nothing in flight."""
    sched = _scheduler(vector_decodes_from)
    seqs = [add_request(sched, i, prompt_len=4, max_tokens=10) for i in range(3)]
    pipe = FakePipeline(sched)
    _decoding(sched, pipe)
    return sched, seqs, pipe


def _decoding(sched: Scheduler, pipe: FakePipeline) -> None:
    """Runs until every running sequence decodes."""
    while sched.waiting or sched.not_decoding:
        pipe.fill()
        pipe.complete_oldest()


def test_join_grow_order_and_leave_keep_counters_with_their_sequence() -> None:
    roster = DecodeRoster(block_size=4, capacity=2)
    seqs = [_decoding_seq(i) for i in range(5)]
    for admit_no, seq in zip([4, 0, 3, 1, 2], seqs, strict=True):
        roster.join(seq, admit_no)  # grows twice, from 2 slots to 8
    assert roster.size == 5 and len(roster.seq_ids) == 8
    roster.check_invariants()
    order = [int(roster.seq_ids[slot]) for slot in roster.order()]
    assert order == [1, 3, 4, 2, 0]  # by admission number, not by joining
    # Reads and writes go to the columns while on the roster.
    seqs[2].num_computed_tokens = 4
    seqs[2].num_inflight_batches = 2
    seqs[2].last_token_time = 9.0
    assert roster.computed[seqs[2]._slot] == 4 and roster.inflight[seqs[2]._slot] == 2
    assert seqs[2].num_computed_tokens == 4 and seqs[2].last_token_time == 9.0
    seqs[2].append_token(7)
    assert roster.num_tokens[seqs[2]._slot] == 5 == seqs[2].num_tokens
    assert roster.max_num_tokens[seqs[2]._slot] == 11
    freed_slot = seqs[2]._slot
    roster.leave(seqs[2])
    assert seqs[2]._roster is None
    assert (seqs[2].num_computed_tokens, seqs[2].num_inflight_batches) == (4, 2)
    assert seqs[2].last_token_time == 9.0
    assert [int(roster.seq_ids[slot]) for slot in roster.order()] == [1, 3, 4, 0]
    assert roster.num_leaves == 1
    roster.check_invariants()
    late = _decoding_seq(9)
    roster.join(late, 5)  # takes the freed slot back
    assert late._slot == freed_slot
    assert len(roster.seq_ids) == 8
    roster.check_invariants()


def test_stop_ids_are_the_union_of_the_members() -> None:
    roster = DecodeRoster(block_size=4)
    a = _decoding_seq(1, stop=frozenset({5, 6}))
    b = _decoding_seq(2, stop=frozenset({6}))
    assert roster.stop_ids().tolist() == []
    roster.join(a, 0)
    roster.join(b, 1)
    assert sorted(roster.stop_ids().tolist()) == [5, 6]
    roster.leave(a)
    assert roster.stop_ids().tolist() == [6]
    roster.check_invariants()
    roster.leave(b)
    assert roster.stop_ids().tolist() == []


@pytest.mark.parametrize("num_stop_ids", [1, 3, 8, 9, 40])
def test_stop_hits_find_every_token_that_is_a_stop_id(num_stop_ids: int) -> None:
    """A few stop ids are compared one by one, many through np.isin: the same positions."""
    from controller.scheduler.scheduler import stop_hits

    rng = np.random.default_rng(num_stop_ids)
    tokens = rng.integers(0, 64, 500).astype(np.int64)
    stop_ids = rng.choice(64, num_stop_ids, replace=False).astype(np.int64)
    expected = [i for i, t in enumerate(tokens.tolist()) if t in set(stop_ids.tolist())]
    assert stop_hits(tokens, stop_ids).tolist() == expected
    assert len(expected) > 0
    assert stop_hits(tokens, np.array([], np.int64)).tolist() == []


def test_decode_block_chunks_are_built_in_micro_batch_order() -> None:
    a, b = _decoding_seq(1), _decoding_seq(2, prompt_len=5)
    block = DecodeBlock(
        np.array([0, 1]), 0, [1, 2], np.array([3, 5]), np.array([a, b], object), [1], [42],
        [101, 0], [1],
    )  # fmt: skip
    prefill = ScheduledChunk(7, 0, 4, False, (3,), [1, 2, 3, 4], None)
    sampled = ScheduledChunk(8, 4, 2, True, (), [5, 6], None)
    batch = MicroBatch(3, [prefill, sampled], [9], 8, block, decodes_at=1)
    assert batch.num_chunks == 4
    assert batch.yielding_seq_ids() == [1, 2, 8]
    chunks = batch.chunks
    assert chunks == [
        prefill,
        ScheduledChunk(1, 3, 1, True, (), [101], None),
        # Sequence 2's decode goes ahead: the worker feeds it the token it sampled last.
        ScheduledChunk(2, 5, 1, True, (42,), [], None, None, ahead=True),
        sampled,
    ]
    a.output_token_ids.append(55)  # a later token does not change what was scheduled
    assert batch.chunks is chunks and chunks[1].token_ids == [101]
    assert batch.other_chunks == [prefill, sampled]
    assert "chunks=4" in repr(batch)


def test_a_plain_micro_batch_is_its_chunks() -> None:
    chunk = ScheduledChunk(1, 0, 2, True, (), [1, 2], None)
    batch = MicroBatch(1, [chunk], [], 2)
    assert batch.chunks == [chunk] and batch.num_chunks == 1 and batch.yielding_seq_ids() == [1]


def test_decoding_sequences_move_to_the_roster_and_off_it_when_they_end(
    vector_decodes_from: int,
) -> None:
    sched = _scheduler(vector_decodes_from)
    seqs = [add_request(sched, i, prompt_len=10 + i, max_tokens=3) for i in range(4)]
    pipe = FakePipeline(sched)
    pipe.fill()
    assert sched.roster.size == 0 and list(sched.not_decoding) == [0, 1, 2, 3]
    pipe.complete_oldest()
    assert sched.roster.size == 4 and not sched.not_decoding
    batch = pipe.fill()[0]
    assert [c.seq_id for c in batch.chunks] == [0, 1, 2, 3]
    assert (batch.decodes is not None) == (vector_decodes_from <= 4)
    sched.check_invariants()
    sched.abort(2)
    assert sched.roster.size == 3 and seqs[2]._roster is None
    pipe.run_to_completion()
    assert sched.roster.size == 0 and all(s._roster is None for s in seqs)
    assert [s.finish_reason for s in seqs] == [FinishReason.LENGTH] * 2 + [
        FinishReason.ABORT,
        FinishReason.LENGTH,
    ]


def test_a_result_skips_an_aborted_decode_whose_slot_was_taken_meanwhile(
    vector_decodes_from: int,
) -> None:
    sched = _scheduler(vector_decodes_from, pipeline_depth=2)
    first = add_request(sched, 1, prompt_len=4, max_tokens=10)
    pipe = FakePipeline(sched)
    pipe.fill()
    pipe.complete_oldest()
    (decode_batch,) = pipe.fill()  # 1's decode in flight
    slot = first._slot
    sched.abort(1)
    second = add_request(sched, 2, prompt_len=4, max_tokens=10)
    (prefill_batch,) = pipe.fill()
    sched.on_result(prefill_batch.batch_id, {2: 77}, 5.0)
    assert second._slot == slot  # the aborted sequence's slot is reused
    pipe.inflight.clear()
    updated = sched.on_result(decode_batch.batch_id, {1: 99}, 6.0)
    assert updated == [] and second.output_token_ids == [77]
    assert second.num_inflight_batches == 0 and first.output_token_ids[-1] != 99
    sched.check_invariants()


def test_a_missing_decode_token_raises_after_applying_the_ones_before_it(
    vector_decodes_from: int,
) -> None:
    sched, seqs, pipe = _three_decoding(vector_decodes_from)
    (batch,) = pipe.fill()
    with pytest.raises(ValueError, match="no token for sequence 1"):
        sched.on_result(batch.batch_id, {0: 5, 2: 6}, 1.0)
    assert seqs[0].output_token_ids[-1] == 5 and seqs[0].num_inflight_batches == 0
    assert seqs[2].output_token_ids[-1] != 6


def test_decode_stop_tokens_and_length_finish_in_micro_batch_order(
    vector_decodes_from: int,
) -> None:
    sched = _scheduler(vector_decodes_from)
    params = RequestParams(max_tokens=5, stop_token_ids=frozenset({13}))
    seqs = [sched.add_request(i, [1, 2, 3], params, 0.0) for i in range(4)]
    pipe = FakePipeline(sched)
    _decoding(sched, pipe)
    (batch,) = pipe.fill()
    done = sched.on_result(batch.batch_id, {0: 1, 1: 13, 2: 2, 3: 13}, 1.0)
    assert [s.seq_id for s in done] == [0, 1, 2, 3]
    assert [s.finish_reason for s in seqs] == [None, FinishReason.STOP, None, FinishReason.STOP]
    (batch,) = pipe.fill()
    assert batch.finished_seq_ids == [1, 3]
    sched.on_result(batch.batch_id, {0: 1, 2: 2}, 2.0)
    (batch,) = pipe.fill()
    sched.on_result(batch.batch_id, {0: 1, 2: 2}, 3.0)
    (batch,) = pipe.fill()
    sched.on_result(batch.batch_id, {0: 1, 2: 13}, 3.0)
    assert seqs[2].finish_reason is FinishReason.LENGTH  # length is checked before stop ids
    assert seqs[0].finish_reason is FinishReason.LENGTH and seqs[0].last_token_time == 3.0
    assert len(seqs[0].output_token_ids) == 5
    sched.check_invariants()


def test_a_recompute_chunk_that_stops_one_token_short_joins_the_roster(
    vector_decodes_from: int,
) -> None:
    # A budget of 8 and 9 known tokens: the recompute's first chunk is 8 tokens, which leaves
    # the last one (an output) to compute as a decode.
    sched = _scheduler(vector_decodes_from, budget_tokens=8, max_num_seqs=4)
    seq = add_request(sched, 1, prompt_len=6, max_tokens=20)
    pipe = FakePipeline(sched)
    while seq.num_tokens < 9:
        pipe.fill()
        pipe.complete_oldest()
    assert seq._roster is not None and not pipe.inflight
    sched.reset_inflight()
    assert seq._roster is None and seq.num_computed_tokens == 0
    (batch,) = pipe.fill()
    assert [(c.num_tokens, c.yields_token) for c in batch.chunks] == [(8, False)]
    assert seq._roster is not None and seq.num_uncomputed_tokens == 1  # it decodes next
    sched.check_invariants()
    pipe.complete_oldest()
    (batch,) = pipe.fill()
    assert (batch.decodes is not None) == (vector_decodes_from == 1)
    assert [(c.first_position, c.num_tokens) for c in batch.chunks] == [(8, 1)]
    assert batch.chunks[0].token_ids == [seq.output_token_ids[-1]]
    pipe.complete_oldest()
    assert seq.output_token_ids[-1] == token_for(1, 8)
    sched.check_invariants()


@pytest.mark.parametrize("spread_decodes", [False, True])
@pytest.mark.parametrize("capped", [True, False])
@pytest.mark.parametrize("pipeline_prefill_chunks", [True, False])
def test_a_vector_block_holds_the_decodes_a_chunk_each_would(
    capped: bool, pipeline_prefill_chunks: bool, spread_decodes: bool
) -> None:
    """The vector path, and the walk it falls back to under memory pressure (and takes for a
    few decodes), pick the same decodes, positions and new blocks."""

    def build(vector: bool) -> tuple[list[tuple[object, ...]], list[tuple[int, ...]]]:
        sched = create_scheduler(
            budget_tokens=16,
            max_num_seqs=16,
            block_size=4,
            pipeline_depth=2,
            pipeline_prefill_chunks=pipeline_prefill_chunks,
            vector_decodes_from=1 if vector else 1 << 30,
            spread_decodes=spread_decodes,
        )
        for i in range(12):
            add_request(sched, i, prompt_len=2 + i % 5, max_tokens=30)
        pipe = FakePipeline(sched)
        for _ in range(9):
            pipe.fill()
            pipe.complete_oldest()
        builder = BatchBuilder(sched, 100.0)
        builder.num_tokens = 12  # 4 decodes fit when capped; 7 are ready
        added = builder.add_decodes(capped)
        assert (builder.decodes is not None) == vector
        # Spread over PP = 2, a micro-batch takes 6 of the 12 decoding sequences' decodes.
        expected = min(4 if capped else 7, 6 if spread_decodes else 12)
        assert added == expected == builder.num_tokens - 12
        batch = MicroBatch(0, builder.chunks, [], builder.num_tokens, builder.decodes)
        state = [
            (s.seq_id, s.num_computed_tokens, s.num_inflight_batches, *s.block_ids)
            for s in sched.running.values()
        ]
        return [tuple(c) for c in batch.chunks], state

    assert build(vector=True) == build(vector=False)


@pytest.mark.parametrize("reverse", [False, True])
def test_tokens_are_matched_by_seq_id_whatever_the_order_of_the_map(
    reverse: bool, vector_decodes_from: int
) -> None:
    sched, seqs, pipe = _three_decoding(vector_decodes_from)
    add_request(sched, 9, prompt_len=5, max_tokens=10)  # a prefill chunk after the decodes
    (batch,) = pipe.fill()
    if vector_decodes_from == 1:
        assert batch.decodes is not None and batch.decodes_at == 0
    assert batch.yielding_seq_ids() == [0, 1, 2, 9]
    items = [(0, 50), (1, 51), (2, 52), (9, 59)]
    sampled = dict(reversed(items) if reverse else items)
    updated = sched.on_result(batch.batch_id, sampled, 1.0)
    assert [s.seq_id for s in updated] == [0, 1, 2, 9]
    assert [s.output_token_ids[-1] for s in seqs] == [50, 51, 52]
    assert sched.get(9).output_token_ids == [59]  # type: ignore[union-attr]
    sched.check_invariants()
