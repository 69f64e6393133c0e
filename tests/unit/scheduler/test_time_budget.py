"""A budget in time: micro-batches filled up to a predicted stage time (StepCostModel) as well
as up to the token budget. Long-context work leaves less room for prompt chunks; a time budget
that never binds changes nothing; every promise of the scheduler still holds."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.scheduler import ConfigError, MicroBatch, SchedulerConfig
from controller.scheduler.step_cost import StepCostModel, attended
from tests.unit.scheduler.factories import FakePipeline, add_request, chunk_map, create_scheduler
from tests.unit.scheduler.test_properties import POLICIES, VECTOR_DECODES_FROM, Request, run

# 1 ms a token, and attention that makes a token over a 1,000-token context cost twice as much.
COST = StepCostModel(fixed_s=0.002, per_token_s=1e-3, per_attended_s=1e-6)


def predicted_s(batch: MicroBatch, cost: StepCostModel = COST) -> float:
    return cost.fixed_s + sum(cost.chunk_s(c.first_position, c.num_tokens) for c in batch.chunks)


@given(
    position=st.integers(0, 100_000),
    time_left=st.floats(0.0, 10.0),
    limit=st.integers(0, 5000),
    per_attended=st.sampled_from([0.0, 1e-9, 1e-6]),
)
def test_largest_chunk_is_the_largest_that_fits(
    position: int, time_left: float, limit: int, per_attended: float
) -> None:
    cost = StepCostModel(per_token_s=1e-3, per_attended_s=per_attended)
    n = cost.largest_chunk(position, time_left, limit)
    assert 0 <= n <= limit
    assert n == 0 or cost.chunk_s(position, n) <= time_left
    assert n == limit or cost.chunk_s(position, n + 1) > time_left


def test_attended_counts_causal_pairs() -> None:
    assert attended(0, 1) == 1 and attended(99, 1) == 100  # a decode over 100 tokens
    assert attended(0, 3) == 1 + 2 + 3 and attended(10, 2) == 11 + 12


def test_a_late_chunk_of_a_long_prompt_is_smaller_than_its_first() -> None:
    sched = create_scheduler(  # prompts not spread: each chunk fills its time budget
        budget_tokens=512, pipeline_depth=16, time_budget_s=0.3, step_cost=COST,
        spread_prompts=False,
    )  # fmt: skip
    add_request(sched, 1, prompt_len=3000, max_tokens=1)
    batches = FakePipeline(sched).fill()
    sizes = [chunk_map(b)[1][1] for b in batches]
    assert sizes[0] == 263  # 0.002 + 0.263 + 0.0347 s of attention = 0.2997 s; 264 is over
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0] // 2
    assert all(predicted_s(b) <= 0.3 for b in batches)


def test_long_context_decodes_leave_less_room_for_a_prompt_chunk() -> None:
    def chunk_beside(decode_context: int) -> int:
        sched = create_scheduler(
            budget_tokens=512,
            max_num_seqs=16,
            num_blocks=4096,
            time_budget_s=0.3,
            step_cost=COST,
        )
        pipeline = FakePipeline(sched)
        for seq_id in range(8):
            add_request(sched, seq_id, prompt_len=decode_context, max_tokens=50)
        while sched.num_waiting or not all(s.is_decoding for s in sched.running.values()):
            pipeline.fill()
            pipeline.complete_oldest()
        add_request(sched, 99, prompt_len=2000, max_tokens=1)
        (batch,) = pipeline.fill()
        assert predicted_s(batch) <= 0.3
        return chunk_map(batch)[99][1]

    assert chunk_beside(100) > chunk_beside(4000)


def test_prompts_progress_even_when_decodes_alone_use_the_time_budget() -> None:
    sched = create_scheduler(
        budget_tokens=512, tile_tokens=32, max_num_seqs=64, time_budget_s=0.01, step_cost=COST
    )
    for seq_id in range(40):
        add_request(sched, seq_id, prompt_len=64, max_tokens=1000)
    pipeline = FakePipeline(sched)
    for _ in range(200):
        pipeline.fill()
        pipeline.complete_oldest()
    assert not sched.num_waiting and all(s.is_decoding for s in sched.running.values())
    add_request(sched, 99, prompt_len=200, max_tokens=1)
    (batch,) = pipeline.fill()
    assert chunk_map(batch)[99] == (0, 32)  # decodes take 40 ms > 10 ms: the prompt gets a tile


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    pp=st.integers(1, 4),
    budget=st.sampled_from([16, 64, 256]),
    num_blocks=st.sampled_from([61, 400]),
    requests=st.lists(
        st.builds(Request, st.integers(0, 60), st.integers(1, 200), st.integers(1, 40)),
        min_size=1,
        max_size=16,
    ),
    vector_decodes_from=VECTOR_DECODES_FROM,
)
def test_a_time_budget_that_never_binds_changes_nothing_and_one_that_does_keeps_every_promise(
    policy: str,
    pp: int,
    budget: int,
    num_blocks: int,
    requests: list[Request],
    vector_decodes_from: int,
) -> None:
    plain = run(policy, pp, budget, num_blocks, requests, vector_decodes_from)
    loose = {"time_budget_s": 1e9, "step_cost": COST}
    assert (
        run(policy, pp, budget, num_blocks, requests, vector_decodes_from, config_overrides=loose)
        == plain
    )
    # Binding (0.02 s: about 16 tokens at position 0): run() checks budgets, order, no
    # starvation, KV accounting and exact completion on every step.
    tight = {"time_budget_s": 0.02, "step_cost": COST}
    run(policy, pp, budget, num_blocks, requests, vector_decodes_from, config_overrides=tight)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("time_budget_s", {"time_budget_s": -1.0}),
        ("step_cost", {"time_budget_s": 0.1}),
    ],
)
def test_bad_time_budget_settings_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="per_attended_s"):
        StepCostModel(per_attended_s=-1.0)
