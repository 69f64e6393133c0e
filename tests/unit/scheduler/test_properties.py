"""Property-based tests: every policy, random arrivals and lengths, pipelines of depth 1 to 4.

The fake pipeline runs micro-batches in order and returns a token per yielding chunk; a checker
watches every micro-batch for the scheduler's promises.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.scheduler import FinishReason, MicroBatch, Scheduler, Sequence
from tests.unit.scheduler.factories import add_request, create_scheduler, token_for

POLICIES = ["sarathi", "vllm", "orca", "request_level", "chunked_only"]


@dataclass
class Request:
    arrival_step: int
    prompt_len: int
    max_tokens: int


@dataclass
class Checker:
    sched: Scheduler
    chunked: bool
    next_position: dict[int, int] = field(default_factory=dict)
    computed_tokens: dict[int, int] = field(default_factory=dict)
    discarded_tokens: dict[int, int] = field(default_factory=dict)
    yielding_inflight: set[int] = field(default_factory=set)
    inflight_chunks: dict[int, int] = field(default_factory=dict)
    num_batches: int = 0

    def on_batch(self, batch: MicroBatch) -> None:
        self.num_batches += 1
        cfg = self.sched.config
        if self.chunked:
            assert batch.num_tokens <= cfg.budget_tokens, "micro-batch over the token budget"
        assert batch.num_tokens == sum(c.num_tokens for c in batch.chunks)
        for seq_id in batch.finished_seq_ids:
            seq = self.sched.get(seq_id)
            if seq is not None:  # preempted: its computed tokens are discarded
                assert seq_id not in self.inflight_chunks, "preempted while in flight"
                self.discarded_tokens[seq_id] = self.discarded_tokens.get(seq_id, 0) + (
                    self.next_position.get(seq_id, 0)
                )
                self.next_position[seq_id] = 0
        seen = set()
        for chunk in batch.chunks:
            assert chunk.seq_id not in seen, "sequence twice in one micro-batch"
            seen.add(chunk.seq_id)
            assert chunk.seq_id not in self.yielding_inflight, (
                "decoding sequence scheduled again before its token returned"
            )
            assert chunk.first_position == self.next_position.get(chunk.seq_id, 0), (
                "chunk out of order"
            )
            assert len(chunk.token_ids) == chunk.num_tokens
            self.next_position[chunk.seq_id] = chunk.first_position + chunk.num_tokens
            self.computed_tokens[chunk.seq_id] = (
                self.computed_tokens.get(chunk.seq_id, 0) + chunk.num_tokens
            )
            self.inflight_chunks[chunk.seq_id] = self.inflight_chunks.get(chunk.seq_id, 0) + 1
            if chunk.yields_token:
                self.yielding_inflight.add(chunk.seq_id)
        assert len({c.seq_id for c in batch.chunks}) <= cfg.max_num_seqs or not self.chunked

    def after_schedule(self) -> None:
        """Under sarathi no paused decode is left out while memory allows it (no stall)."""
        if self.sched.config.policy != "sarathi":
            return
        if self.sched.num_inflight_batches >= self.sched.config.pipeline_depth:
            return
        if self.sched.block_manager.num_free == 0:
            return
        for seq in self.sched.running.values():
            assert not seq.is_decoding, f"{seq} stalled although memory allowed it"

    def on_result(self, batch: MicroBatch) -> None:
        for chunk in batch.chunks:
            self.inflight_chunks[chunk.seq_id] -= 1
            if not self.inflight_chunks[chunk.seq_id]:
                del self.inflight_chunks[chunk.seq_id]
            self.yielding_inflight.discard(chunk.seq_id)


def run(
    policy: str,
    pp: int,
    budget: int,
    num_blocks: int,
    requests: list[Request],
    vector_decodes_from: int = 1,
    abort_steps: Mapping[int, int] | None = None,
) -> list[tuple[object, ...]]:
    """Runs requests to the end, checking the scheduler's promises on the way; abort_steps:
    step -> index of a request to abort then. Returns the run's trace: every micro-batch (its
    chunks as records, the finished ids) and every result (sequence ids, finish reasons)."""
    abort_steps = abort_steps or {}
    sched = create_scheduler(
        policy=policy,
        budget_tokens=budget,
        max_num_seqs=min(8, budget),
        pipeline_depth=pp,
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=512,
        vector_decodes_from=vector_decodes_from,
    )
    checker = Checker(sched, chunked=policy in ("sarathi", "chunked_only"))
    pending = deque(sorted(enumerate(requests), key=lambda r: r[1].arrival_step))
    seqs: list[Sequence] = []
    inflight: deque[MicroBatch] = deque()
    trace: list[tuple[object, ...]] = []
    step = 0
    while pending or sched.has_unfinished:
        step += 1
        assert step < 20_000, "no progress"
        while pending and pending[0][1].arrival_step <= step:
            seq_id, req = pending.popleft()
            seqs.append(add_request(sched, seq_id, req.prompt_len, req.max_tokens, float(step)))
        if step in abort_steps:
            sched.abort(abort_steps[step])
        while (batch := sched.schedule(float(step))) is not None:
            checker.on_batch(batch)
            trace.append((tuple(map(tuple, batch.chunks)), tuple(batch.finished_seq_ids)))
            inflight.append(batch)
        checker.after_schedule()
        if not inflight:
            assert not sched.has_unfinished or pending, "work left but nothing scheduled"
            continue
        batch = inflight.popleft()
        sampled = {
            c.seq_id: token_for(c.seq_id, c.context_len - 1) for c in batch.chunks if c.yields_token
        }
        updated = sched.on_result(batch.batch_id, sampled, float(step))
        trace.append(tuple((s.seq_id, s.finish_reason) for s in updated))
        checker.on_result(batch)
        sched.check_invariants()

    assert sched.block_manager.num_free == sched.block_manager.num_blocks, "blocks leaked"
    for seq in seqs:
        # each token follows the one before it, also across preemptions (no token lost or repeated)
        num_prompt = len(seq.prompt_token_ids)
        assert seq.output_token_ids == [
            token_for(seq.seq_id, num_prompt - 1 + i) for i in range(len(seq.output_token_ids))
        ]
        if seq.finish_reason is FinishReason.ABORT:
            continue
        # ignore_eos: exactly max_tokens outputs
        assert seq.finish_reason is FinishReason.LENGTH
        assert len(seq.output_token_ids) == seq.params.max_tokens
        # every token computed once (the last output is never fed back), plus recomputation
        expected = seq.num_tokens - 1 + checker.discarded_tokens.get(seq.seq_id, 0)
        assert checker.computed_tokens[seq.seq_id] == expected
    return trace


# Decodes always as a vector block, as one chunk each, or switching as the roster passes 3.
VECTOR_DECODES_FROM = st.sampled_from([1, 3, 1 << 30])

requests_strategy = st.lists(
    st.builds(
        Request,
        arrival_step=st.integers(0, 60),
        prompt_len=st.integers(1, 200),
        max_tokens=st.integers(1, 40),
    ),
    min_size=1,
    max_size=24,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    pp=st.integers(1, 4),
    budget=st.sampled_from([8, 16, 64, 256]),
    num_blocks=st.integers(64, 400),
    requests=requests_strategy,
    vector_decodes_from=VECTOR_DECODES_FROM,
)
def test_policies_keep_their_promises(
    policy: str,
    pp: int,
    budget: int,
    num_blocks: int,
    requests: list[Request],
    vector_decodes_from: int,
) -> None:
    run(policy, pp, budget, num_blocks, requests, vector_decodes_from)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    pp=st.integers(1, 4),
    requests=requests_strategy,
    vector_decodes_from=VECTOR_DECODES_FROM,
)
def test_promises_hold_under_memory_pressure_with_preemption(
    policy: str, pp: int, requests: list[Request], vector_decodes_from: int
) -> None:
    # 61 blocks of 4 tokens: one request of 200 + 40 tokens takes 60, so sequences collide.
    run(policy, pp, 64, 61, requests, vector_decodes_from)


def test_memory_pressure_run_does_preempt() -> None:
    # Guards the property test above against testing nothing: this workload must preempt.
    sched_requests = [Request(0, 100, 40) for _ in range(6)]
    sched = create_scheduler(budget_tokens=64, max_num_seqs=8, num_blocks=61, block_size=4)
    for seq_id, req in enumerate(sched_requests):
        add_request(sched, seq_id, req.prompt_len, req.max_tokens)
    from tests.unit.scheduler.factories import FakePipeline

    FakePipeline(sched).run_to_completion()
    assert sched.num_preemptions > 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    pp=st.integers(1, 4),
    num_blocks=st.sampled_from([61, 400]),
    requests=requests_strategy,
    abort_steps=st.dictionaries(st.integers(1, 200), st.integers(0, 23), max_size=4),
)
def test_vector_block_and_chunk_each_decodes_schedule_the_same(
    policy: str, pp: int, num_blocks: int, requests: list[Request], abort_steps: dict[int, int]
) -> None:
    """The two ways decodes travel are a speed choice only: the same micro-batches (chunk for
    chunk, in order) and the same results, with preemption and aborts."""
    runs = [
        run(policy, pp, 16, num_blocks, requests, vector_from, abort_steps)
        for vector_from in (1, 3, 1 << 30)
    ]
    assert runs[0] == runs[1] == runs[2]
