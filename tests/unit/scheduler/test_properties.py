"""Property-based tests: every policy, random arrivals and lengths, pipelines of depth 1 to 4.

The fake pipeline runs micro-batches in order and returns a token per yielding chunk; a checker
watches every micro-batch for the scheduler's promises, among them (PP > 1) how the decodes are
spread over the micro-batches in flight.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.scheduler import (
    FinishReason,
    MicroBatch,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)
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
    # Tokens a sequence started past, taken from the prefix cache (a recompute after preemption
    # finds its own blocks while they last).
    cached_tokens: dict[int, int] = field(default_factory=dict)
    # Yielding chunks in flight per sequence: one, or two where a decode went ahead.
    yielding_inflight: dict[int, int] = field(default_factory=dict)
    inflight_chunks: dict[int, int] = field(default_factory=dict)
    num_batches: int = 0
    # Spread decodes (PP > 1): decoding sequences ready before the build being checked; per
    # ready sequence, the micro-batches carrying decodes that passed it over since it was ready.
    ready: set[int] = field(default_factory=set)
    passed_over: dict[int, int] = field(default_factory=dict)
    num_decoding: int = 0
    preemptions: int = 0
    # A fill (micro-batches built with no result in between) that starts with nothing in flight
    # and every decoding sequence ready: the decodes each of its micro-batches carried.
    fill_decodes: list[int] | None = None
    fill_start: tuple[int, int] = (0, 0)
    # How often the checks below had something to check (guards against testing nothing).
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def start_fill(self) -> None:
        sched = self.sched
        self.fill_decodes = None
        if sched.spread_decodes and not sched.num_inflight_batches and sched.roster.size:
            self.fill_decodes = []
            self.fill_start = (sched.roster.size, sched.num_preemptions)

    def running(self, seq_id: int) -> bool:
        seq = self.sched.get(seq_id)
        return seq is not None and seq.status is SequenceStatus.RUNNING

    def before_schedule(self) -> None:
        # A decode follows a chunk still in flight only when chunks may follow each other.
        pipelined = self.sched.config.pipeline_prefill_chunks
        self.ready = {
            s.seq_id
            for s in self.sched.running.values()
            if s.is_decoding and (pipelined or not s.num_inflight_batches)
        }
        self.num_decoding = self.sched.roster.size
        self.preemptions = self.sched.num_preemptions

    def spread_checks(self, batch: MicroBatch) -> None:
        """With PP > 1: a ready decode is passed over by at most PP - 1 micro-batches that carry
        decodes (so it goes within PP of them), and only by a micro-batch that already carries
        its share of the decodes, whatever prompt chunks wait; no micro-batch carries more than
        its share unless decodes passed over PP - 1 times go beyond it."""
        sched = self.sched
        pp = sched.config.pipeline_depth
        decodes = {c.seq_id for c in batch.chunks} & self.ready
        # A decode may have lacked a KV block (and preempted, or waited for one).
        memory_bound = sched.block_manager.num_free == 0 or sched.num_preemptions > self.preemptions
        for seq_id in [i for i in self.passed_over if not self.running(i)]:
            del self.passed_over[seq_id]  # aborted or preempted since
        if self.fill_decodes is not None:
            self.fill_decodes.append(len(decodes))
        if not decodes:
            if self.ready and sched.config.policy in ("sarathi", "orca"):
                # These add decodes to every micro-batch: none goes only for want of memory.
                assert memory_bound, "ready decodes but a micro-batch without any"
            return
        forced = sum(1 for i in self.ready if self.passed_over.get(i, 0) >= pp - 1)
        share = -(-self.num_decoding // pp)
        assert len(decodes) <= max(share, forced), "a micro-batch took more than its share"
        left = 0
        for seq_id in self.ready:
            if seq_id in decodes or not self.running(seq_id):  # went, or preempted meanwhile
                self.passed_over.pop(seq_id, None)
            else:
                self.passed_over[seq_id] = self.passed_over.get(seq_id, 0) + 1
                left += 1
        if left:
            self.count("passed over")
        if memory_bound:
            return
        if left:
            assert len(decodes) >= max(1, self.num_decoding // pp), (
                "a decode was passed over by a micro-batch short of its share"
            )
        worst = max(self.passed_over.values(), default=0)
        if worst:
            self.count(f"passed over {worst} times")
        assert worst <= pp - 1, f"a ready decode passed over by {worst} micro-batches, PP={pp}"

    def end_fill(self) -> None:
        """Every decoding sequence ready and nothing in flight: the next PP micro-batches carry
        all of them, within 1 of each other (a slot left empty counts 0). Not checked when
        memory ran short, membership changed (a preemption, a recompute joining the decode
        roster) or the policy left decodes out of a micro-batch (vllm admitting prompts)."""
        sched = self.sched
        counts, self.fill_decodes = self.fill_decodes, None
        if counts is None or not counts:
            return
        num_decoding, preemptions = self.fill_start
        if sched.num_preemptions != preemptions or sched.roster.size != num_decoding:
            return
        pp = sched.config.pipeline_depth
        taken = list(itertools.takewhile(bool, counts))
        if sum(taken) < num_decoding and len(taken) < pp:
            # A micro-batch without decodes while some were ready (the policy's stall, or for
            # want of memory: both checked above), or the fill ended (for want of memory).
            return
        taken += [0] * (pp - len(taken))
        assert sum(taken) == num_decoding, f"not every ready decode went in one round: {counts}"
        assert max(taken) - min(taken) <= 1, f"decodes spread unevenly: {taken}"
        self.count("balanced fill")

    def on_batch(self, batch: MicroBatch) -> None:
        self.num_batches += 1
        cfg = self.sched.config
        if self.chunked:
            # The idle budget, only while no sequence decodes (num_decoding: before this build).
            idle = cfg.idle_budget_tokens and not self.num_decoding
            if batch.num_tokens > cfg.budget_tokens:
                self.count("idle budget")
            limit = cfg.idle_budget_tokens if idle else cfg.budget_tokens
            assert batch.num_tokens <= limit, "micro-batch over the token budget"
            if batch.num_tokens > cfg.budget_tokens:
                # Nor may a sequence start decoding while it runs: nothing else is in flight.
                assert self.sched.num_inflight_batches == 1, "idle budget beside another"
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
            if chunk.ahead:
                # Only behind its one decode in flight, never past its last token by length.
                assert cfg.decode_ahead and chunk.num_tokens == 1 and chunk.yields_token
                assert self.yielding_inflight.get(chunk.seq_id) == 1, "ahead of nothing"
                seq = self.sched.get(chunk.seq_id)
                assert chunk.first_position + 1 < len(seq.prompt_token_ids) + seq.max_tokens
                self.count("ahead")
            else:
                assert chunk.seq_id not in self.yielding_inflight, (
                    "decoding sequence scheduled again before its token returned"
                )
            start = self.next_position.get(chunk.seq_id, 0)
            if chunk.sampling is not None and chunk.first_position > start:
                # The workers meet it past its start: that much came from the prefix cache.
                assert start == 0 and chunk.first_position < self.sched.get(chunk.seq_id).num_tokens
                self.cached_tokens[chunk.seq_id] = (
                    self.cached_tokens.get(chunk.seq_id, 0) + chunk.first_position
                )
                self.count("cache hit")
                start = chunk.first_position
            assert chunk.first_position == start, "chunk out of order"
            assert len(chunk.token_ids) == (0 if chunk.ahead else chunk.num_tokens)
            self.next_position[chunk.seq_id] = chunk.first_position + chunk.num_tokens
            self.computed_tokens[chunk.seq_id] = (
                self.computed_tokens.get(chunk.seq_id, 0) + chunk.num_tokens
            )
            self.inflight_chunks[chunk.seq_id] = self.inflight_chunks.get(chunk.seq_id, 0) + 1
            if chunk.yields_token:
                self.yielding_inflight[chunk.seq_id] = (
                    self.yielding_inflight.get(chunk.seq_id, 0) + 1
                )
        assert len({c.seq_id for c in batch.chunks}) <= cfg.max_num_seqs or not self.chunked
        if self.sched.spread_decodes:
            self.spread_checks(batch)

    def after_schedule(self) -> None:
        """Under sarathi no paused decode is left out while memory allows it (no stall)."""
        if self.sched.config.policy != "sarathi":
            return
        if self.sched.num_inflight_batches >= self.sched.config.max_inflight_batches:
            return
        if self.sched.block_manager.num_free == 0:
            return
        pipelined = self.sched.config.pipeline_prefill_chunks
        for seq in self.sched.running.values():
            # Without chunk pipelining a decode waits for its sequence's chunk in flight.
            if pipelined or not seq.num_inflight_batches:
                assert not seq.is_decoding, f"{seq} stalled although memory allowed it"

    def on_result(self, batch: MicroBatch) -> None:
        for chunk in batch.chunks:
            self.inflight_chunks[chunk.seq_id] -= 1
            if not self.inflight_chunks[chunk.seq_id]:
                del self.inflight_chunks[chunk.seq_id]
            if chunk.yields_token:
                left = self.yielding_inflight.pop(chunk.seq_id) - 1
                if left:
                    self.yielding_inflight[chunk.seq_id] = left


def run(
    policy: str,
    pp: int,
    budget: int,
    num_blocks: int,
    requests: list[Request],
    vector_decodes_from: int = 1,
    abort_steps: Mapping[int, int] | None = None,
    spread_decodes: bool = True,
    checker_out: list[Checker] | None = None,
    max_num_seqs: int = 8,
    pipeline_prefill_chunks: bool = True,
    config_overrides: Mapping[str, Any] | None = None,
    spread_prompts: bool = SchedulerConfig.spread_prompts,
) -> list[tuple[object, ...]]:
    """Runs requests to the end, checking the scheduler's promises on the way; abort_steps:
    step -> index of a request to abort then; checker_out: gets the checker, for its counts.
    Returns the run's trace: every micro-batch (its chunks as records, the finished ids) and
    every result (sequence ids, finish reasons)."""
    abort_steps = abort_steps or {}
    sched = create_scheduler(
        policy=policy,
        budget_tokens=budget,
        max_num_seqs=min(max_num_seqs, budget),
        pipeline_depth=pp,
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=512,
        vector_decodes_from=vector_decodes_from,
        spread_decodes=spread_decodes,
        spread_prompts=spread_prompts,
        pipeline_prefill_chunks=pipeline_prefill_chunks,
        **(config_overrides or {}),
    )
    checker = Checker(sched, chunked=policy in ("sarathi", "chunked_only"))
    if checker_out is not None:
        checker_out.append(checker)
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
        schedule_all(sched, checker, float(step), inflight, trace)
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
    check_outputs(sched, checker, seqs)
    return trace


def schedule_all(
    sched: Scheduler,
    checker: Checker,
    now: float,
    inflight: deque[MicroBatch],
    trace: list[tuple[object, ...]],
) -> None:
    """One step's scheduling: micro-batches until the scheduler has none, each checked, traced
    and put in flight."""
    checker.start_fill()
    while True:
        checker.before_schedule()
        if (batch := sched.schedule(now)) is None:
            break
        checker.on_batch(batch)
        trace.append((tuple(map(tuple, batch.chunks)), tuple(batch.finished_seq_ids)))
        inflight.append(batch)
    checker.end_fill()
    checker.after_schedule()


def check_outputs(sched: Scheduler, checker: Checker, seqs: list[Sequence]) -> None:
    """At the end of a run: no block leaked, and every sequence's tokens are whole."""
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
        # every token computed once (the last output is never fed back), plus recomputation,
        # less what came from the prefix cache
        expected = (
            seq.num_tokens
            - 1
            + checker.discarded_tokens.get(seq.seq_id, 0)
            - checker.cached_tokens.get(seq.seq_id, 0)
        )
        assert checker.computed_tokens[seq.seq_id] == expected


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


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["sarathi", "chunked_only"]),
    budget=st.sampled_from([8, 16, 64]),
    idle_factor=st.sampled_from([1, 2, 8]),
    num_blocks=st.sampled_from([61, 400]),
    requests=requests_strategy,
    abort_steps=st.dictionaries(st.integers(1, 200), st.integers(0, 23), max_size=3),
    decode_ahead=st.booleans(),
)
def test_promises_hold_with_an_idle_budget(
    policy: str,
    budget: int,
    idle_factor: int,
    num_blocks: int,
    requests: list[Request],
    abort_steps: dict[int, int],
    decode_ahead: bool,
) -> None:
    """PP=1 with larger micro-batches while nothing decodes: the same promises (no stall, the
    budget whenever a decode runs or may start while it runs, every output complete), under
    preemption and aborts, with decodes ahead of their tokens or not."""
    overrides = {"idle_budget_tokens": budget * idle_factor, "decode_ahead": decode_ahead}
    run(policy, 1, budget, num_blocks, requests, 3, abort_steps, config_overrides=overrides)


def test_idle_budget_run_does_take_larger_micro_batches() -> None:
    """The property above checks something: spaced prompts do go over the budget while idle."""
    checkers: list[Checker] = []
    requests = [Request(arrival_step=3 * i, prompt_len=150, max_tokens=5) for i in range(6)]
    overrides = {"idle_budget_tokens": 128}
    run("sarathi", 1, 16, 400, requests, 3, checker_out=checkers, config_overrides=overrides)
    assert checkers[0].counts.get("idle budget", 0) >= 3


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


# ---- decodes spread over the pipeline (PP > 1) ------------------------------------------------
# The checker above checks the spreading on every micro-batch of every run with PP > 1 (so the
# tests above check it too, with preemption and aborts); the tests below aim at it.

ABORTS = st.dictionaries(st.integers(1, 200), st.integers(0, 47), max_size=6)

# Runs with one stage (PP = 1), with KV blocks short or not and aborts in every state.
one_stage_runs = given(
    policy=st.sampled_from(POLICIES),
    budget=st.sampled_from([8, 16, 64, 256]),
    num_blocks=st.sampled_from([61, 400]),
    requests=requests_strategy,
    abort_steps=ABORTS,
    vector_decodes_from=VECTOR_DECODES_FROM,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@one_stage_runs
def test_with_one_stage_spreading_changes_nothing(
    policy: str,
    budget: int,
    num_blocks: int,
    requests: list[Request],
    abort_steps: dict[int, int],
    vector_decodes_from: int,
) -> None:
    """PP = 1: the micro-batches, chunk for chunk, and the results are those of the scheduler
    that puts every ready decode into the next micro-batch (spread_decodes=False), with
    preemption and aborts."""
    runs = [
        run(policy, 1, budget, num_blocks, requests, vector_decodes_from, abort_steps, spread)
        for spread in (True, False)
    ]
    assert runs[0] == runs[1]


# Many short requests at once, so that dozens decode together and finish in bunches.
many_requests = st.lists(
    st.builds(
        Request,
        arrival_step=st.integers(0, 30),
        prompt_len=st.integers(1, 40),
        max_tokens=st.integers(1, 60),
    ),
    min_size=1,
    max_size=48,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    pp=st.integers(2, 4),
    budget=st.sampled_from([32, 64, 256]),
    requests=many_requests,
    vector_decodes_from=VECTOR_DECODES_FROM,
)
def test_decodes_are_spread_over_the_pipeline(
    policy: str, pp: int, budget: int, requests: list[Request], vector_decodes_from: int
) -> None:
    """PP in 2..4, up to 32 sequences decoding together: each ready decode goes within PP
    micro-batches that carry decodes, none takes more than its share, with everything ready
    the PP micro-batches differ by at most one decode, and the budgets hold (the checker)."""
    run(policy, pp, budget, 2000, requests, vector_decodes_from, max_num_seqs=32)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    pp=st.integers(2, 4),
    num_blocks=st.sampled_from([30, 61, 120]),
    requests=many_requests,
    abort_steps=ABORTS,
    vector_decodes_from=VECTOR_DECODES_FROM,
    pipelined=st.booleans(),
)
def test_spread_decodes_keep_their_bound_with_preemption_and_aborts(
    policy: str,
    pp: int,
    num_blocks: int,
    requests: list[Request],
    abort_steps: dict[int, int],
    vector_decodes_from: int,
    pipelined: bool,
) -> None:
    """The same with KV blocks short (preemption by recompute) and aborts in every state, with
    and without prompt chunks following each other in the pipeline, and the vector block and
    the per-sequence walk still make the same micro-batches."""
    traces = [
        run(
            policy,
            pp,
            64,
            num_blocks,
            requests,
            vector_from,
            abort_steps,
            max_num_seqs=32,
            pipeline_prefill_chunks=pipelined,
        )
        for vector_from in (vector_decodes_from, 1 << 30)
    ]
    assert traces[0] == traces[1]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_spread_checks_have_something_to_check(pp: int) -> None:
    """Guards the property tests above against checking nothing: on this workload (30 prompts
    that finish together while a long one fills the other slots, then more arrivals, aborts,
    and, the second time, KV blocks short) decodes are passed over, up to PP - 1 times, fills
    with every decode ready are checked for balance, and sequences are preempted."""
    requests = [Request(0, 2, 30) for _ in range(30)] + [Request(0, 190, 5)]
    requests += [Request(20, 3 + i % 7, 5 + i % 20) for i in range(16)]
    seen: dict[str, int] = {}
    preemptions = 0
    for num_blocks in (2000, 120):
        checkers: list[Checker] = []
        aborts = {25: 3, 26: 40}
        run("sarathi", pp, 64, num_blocks, requests, 1, aborts, True, checkers, max_num_seqs=32)
        for what, n in checkers[0].counts.items():
            seen[what] = seen.get(what, 0) + n
        preemptions += checkers[0].sched.num_preemptions
    assert seen.get("balanced fill", 0) > 0, seen
    assert seen.get(f"passed over {pp - 1} times", 0) > 0, seen
    assert preemptions > 0


@pytest.mark.parametrize(
    ("pp", "pipelined", "requests"),
    [
        (2, False, [(6, 8, 7), (10, 17, 29), (0, 21, 7), (9, 8, 16), (3, 20, 24), (0, 2, 15)]),
        (3, True, [(7, 23, 26), (4, 5, 17), (1, 3, 23), (10, 1, 22), (2, 29, 7), (1, 1, 18)]),
    ],
)
def test_a_chosen_decode_short_of_a_block_gives_its_place_to_another(
    pp: int, pipelined: bool, requests: list[tuple[int, int, int]]
) -> None:
    """Found by a search: KV blocks so short (20 of 4 tokens) that the decode a micro-batch
    chose preempts itself for a block. A ready decode it had passed over takes its place, or
    the micro-batch would go without decodes (or not at all) while memory allowed one."""
    reqs = [Request(*r) for r in requests]
    run("sarathi", pp, 32, 20, reqs, 1 << 30, max_num_seqs=32, pipeline_prefill_chunks=pipelined)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["sarathi", "chunked_only"]),
    pp=st.integers(1, 4),
    num_blocks=st.sampled_from([30, 61, 400]),
    requests=many_requests,
    abort_steps=ABORTS,
    pipelined=st.booleans(),
)
def test_spread_prompts_keep_every_promise(
    policy: str,
    pp: int,
    num_blocks: int,
    requests: list[Request],
    abort_steps: dict[int, int],
    pipelined: bool,
) -> None:
    """Prompt tokens shared out over the micro-batches in flight (the default): budgets, the spread
    of decodes, every token once, preemption and aborts all hold as without; with one stage, or
    without pipelined chunks, it changes nothing."""
    traces = [
        run(policy, pp, 64, num_blocks, requests, 1, abort_steps, max_num_seqs=32,
            pipeline_prefill_chunks=pipelined, spread_prompts=spread)
        for spread in (True, False)
    ]  # fmt: skip
    if pp == 1 or not pipelined:
        assert traces[0] == traces[1]


# ---- decodes ahead of their tokens (PP = 1) --------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@one_stage_runs
def test_decodes_ahead_keep_every_promise(
    policy: str,
    budget: int,
    num_blocks: int,
    requests: list[Request],
    abort_steps: dict[int, int],
    vector_decodes_from: int,
) -> None:
    """With decodes going ahead (two micro-batches in flight at PP = 1), with preemption and
    aborts: every token follows the one before, none is computed twice or past a sequence's
    length, no block leaks, and the vector block and the walk make the same micro-batches."""
    traces = [
        run(
            policy,
            1,
            budget,
            num_blocks,
            requests,
            vector_from,
            abort_steps,
            config_overrides={"decode_ahead": True},
        )
        for vector_from in (vector_decodes_from, 1 << 30)
    ]
    assert traces[0] == traces[1]


@pytest.mark.parametrize("vector_decodes_from", [1, 1 << 30], ids=["columns", "chunks"])
def test_decodes_ahead_checks_have_something_to_check(vector_decodes_from: int) -> None:
    """Guards the test above against checking nothing: here decodes go ahead, and KV blocks
    run short so sequences are preempted too."""
    requests = [Request(0, 30, 40) for _ in range(6)] + [Request(5, 100, 20)]
    checkers: list[Checker] = []
    run("sarathi", 1, 64, 40, requests, vector_decodes_from, {60: 2},
        checker_out=checkers, config_overrides={"decode_ahead": True})  # fmt: skip
    counts = checkers[0].counts
    assert counts.get("ahead", 0) > 100, counts
    assert checkers[0].sched.num_preemptions > 0
