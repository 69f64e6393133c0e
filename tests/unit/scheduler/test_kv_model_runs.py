"""Every policy, with prefix caching, forks (n > 1), decodes ahead, preemption and aborts,
against a worker that computes from a modelled KV cache (kv_model.py): every output is the one
its prompt alone gives, and no block is left held.

Mutation-checked when written (session 39): dropping the block copies (copy-on-write of a
partly shared block), or naming prefix blocks up to the known tokens rather than the computed
ones, makes this test fail.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.scheduler import (
    CacheConfig,
    FinishReason,
    MicroBatch,
    RequestParams,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
)
from tests.unit.scheduler.kv_model import VOCAB, KVWorker, ideal_output

POLICIES = ["sarathi", "vllm", "orca", "request_level", "chunked_only"]
TOKENS = st.integers(0, VOCAB - 1)


@dataclass(frozen=True)
class Request:
    arrival_step: int
    prefix: int
    """Which shared prefix the prompt starts with (-1: none)."""
    suffix: list[int]
    max_tokens: int
    n: int
    stop_id: int | None


@dataclass(frozen=True)
class Setup:
    policy: str
    pipeline_depth: int
    decode_ahead: bool
    block_size: int
    num_blocks: int
    prefix_caching: bool
    vector_decodes_from: int
    eager: bool
    """The worker runs each micro-batch as soon as it is built (else as late as it can: when
    its result is due); both are orders a stage may take."""


setups = st.builds(
    Setup,
    policy=st.sampled_from(POLICIES),
    pipeline_depth=st.sampled_from([1, 1, 2, 3]),
    decode_ahead=st.booleans(),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.sampled_from([16, 24, 200]),
    prefix_caching=st.booleans(),
    vector_decodes_from=st.sampled_from([1, 3, 1 << 30]),
    eager=st.booleans(),
)
requests = st.lists(
    st.builds(
        Request,
        arrival_step=st.integers(0, 30),
        prefix=st.integers(-1, 1),
        suffix=st.lists(TOKENS, min_size=1, max_size=10),
        max_tokens=st.integers(1, 12),
        n=st.sampled_from([1, 1, 2, 3]),
        stop_id=st.none() | TOKENS,
    ),
    min_size=1,
    max_size=8,
)


@dataclass
class Counts:
    """What a run did that the property has to get right (guards it against testing nothing)."""

    cached_tokens: int = 0
    block_copies: int = 0
    ahead: int = 0
    preemptions: int = 0

    def add(self, batch: MicroBatch) -> None:
        self.cached_tokens += batch.num_cached_tokens
        self.block_copies += len(batch.block_copies)
        self.ahead += sum(1 for c in batch.chunks if c.ahead)


def make_scheduler(setup: Setup) -> Scheduler:
    config = SchedulerConfig(
        policy=setup.policy,
        budget_tokens=16,
        tile_tokens=1,
        max_num_seqs=4,
        max_model_len=256,
        pipeline_depth=setup.pipeline_depth,
        decode_ahead=setup.decode_ahead and setup.pipeline_depth == 1,
    )
    cache = CacheConfig(
        block_size=setup.block_size,
        num_blocks=setup.num_blocks,
        watermark=0.0,
        prefix_caching=setup.prefix_caching,
    )
    return Scheduler(config, cache, setup.vector_decodes_from)


def admit(
    sched: Scheduler, req: Request, prompt: list[int], first_id: int, now: float
) -> dict[int, tuple[Sequence, list[int]]]:
    """Queues the request's n choices (each with its own seed); returns each one with its ideal
    output. A request the cache can never hold is left out (the scheduler refuses it)."""
    stops = frozenset() if req.stop_id is None else frozenset({req.stop_id})
    ids = list(range(first_id, first_id + req.n))
    params = [
        RequestParams(
            max_tokens=req.max_tokens, stop_token_ids=stops, sampling=SamplingParams(seed=i)
        )
        for i in ids
    ]
    block_size = sched.block_manager.block_size
    if -(-(len(prompt) + req.max_tokens) // block_size) > sched.block_manager.num_blocks:
        return {}
    seqs = sched.add_request_group(ids, prompt, params, now)
    return {s.seq_id: (s, ideal_output(prompt, s.seq_id, req.max_tokens, stops)) for s in seqs}


def run(
    setup: Setup,
    reqs: list[Request],
    prefixes: list[list[int]],
    aborts: dict[int, int],
    counts: Counts | None = None,
) -> dict[int, tuple[Sequence, list[int]]]:
    """Runs the requests to the end through a KVWorker; returns every sequence with its ideal
    output. aborts: step -> which sequence admitted so far to abort then (an index into them);
    counts: gets what the run did."""
    counts = Counts() if counts is None else counts
    sched = make_scheduler(setup)
    worker = KVWorker(setup.block_size)
    pending = deque(sorted(reqs, key=lambda r: r.arrival_step))
    admitted: dict[int, tuple[Sequence, list[int]]] = {}
    inflight: deque[tuple[MicroBatch, dict[int, int] | None]] = deque()
    step = next_id = 0
    while pending or sched.has_unfinished or inflight:
        step += 1
        assert step < 5_000, "no progress"
        while pending and pending[0].arrival_step <= step:
            req = pending.popleft()
            prompt = (prefixes[req.prefix] if req.prefix >= 0 else []) + req.suffix
            admitted |= admit(sched, req, prompt, next_id, float(step))
            next_id += req.n
        if step in aborts and admitted:
            sched.abort(sorted(admitted)[aborts[step] % len(admitted)])
        while (batch := sched.schedule(float(step))) is not None:
            counts.add(batch)
            inflight.append((batch, worker.run(batch) if setup.eager else None))
        if inflight:
            batch, sampled = inflight.popleft()
            sched.on_result(batch.batch_id, worker.run(batch) if sampled is None else sampled, 0.0)
            sched.check_invariants()
    assert sched.block_manager.num_free == sched.block_manager.num_blocks, "blocks left held"
    counts.preemptions += sched.num_preemptions
    return admitted


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    setup=setups,
    reqs=requests,
    prefixes=st.lists(st.lists(TOKENS, min_size=1, max_size=12), min_size=2, max_size=2),
    aborts=st.dictionaries(st.integers(1, 60), st.integers(0, 20), max_size=3),
)
def test_every_output_is_the_one_its_prompt_alone_gives(
    setup: Setup, reqs: list[Request], prefixes: list[list[int]], aborts: dict[int, int]
) -> None:
    for seq_id, (seq, ideal) in run(setup, reqs, prefixes, aborts).items():
        out = seq.output_token_ids
        if seq.finish_reason is FinishReason.ABORT:
            assert out == ideal[: len(out)], seq_id
        else:
            assert out == ideal, (seq_id, seq.finish_reason)


def test_the_runs_above_share_fork_preempt_and_go_ahead() -> None:
    """The property above has something to find: workloads of its kind take blocks from the
    prefix cache, copy a forked choice's partial block, preempt and go ahead, and still give
    every output its prompt alone gives."""
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5]]
    reqs = [Request(i % 4, i % 2, [i, i + 1], 10, 1 + i % 3, None) for i in range(8)]
    counts = Counts()
    for num_blocks in (16, 200):  # preemptions; a block copied
        setup = Setup("sarathi", 1, True, 4, num_blocks, True, 3, False)
        for seq, ideal in run(setup, reqs, prefixes, {}, counts).values():
            assert seq.output_token_ids == ideal
    assert counts.cached_tokens > 0 and counts.block_copies > 0
    assert counts.preemptions > 0 and counts.ahead > 0
