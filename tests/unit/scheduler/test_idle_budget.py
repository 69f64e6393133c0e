"""The idle budget (PP=1): while no sequence decodes, a prompt goes in chunks of up to
idle_budget_tokens, so its first token costs fewer steps; as soon as one sequence decodes, every
micro-batch is back within the budget, so no decode waits behind a large chunk."""

from __future__ import annotations

from controller.scheduler.step_cost import StepCostModel
from tests.unit.scheduler.factories import FakePipeline, add_request, chunk_map, create_scheduler


def test_a_prompt_alone_goes_in_idle_budget_chunks() -> None:
    sched = create_scheduler(budget_tokens=64, idle_budget_tokens=512)
    add_request(sched, 1, prompt_len=1200, max_tokens=3)
    pipe = FakePipeline(sched)
    sizes = []
    while sched.has_unfinished:
        sizes += [chunk_map(b)[1][1] for b in pipe.fill()]
        pipe.complete_oldest()
    # Three prompt chunks instead of 19 of the budget, then its decodes.
    assert sizes == [512, 512, 176, 1, 1]


def test_without_an_idle_budget_the_budget_holds() -> None:
    sched = create_scheduler(budget_tokens=64)
    add_request(sched, 1, prompt_len=384, max_tokens=1)
    pipe = FakePipeline(sched)
    assert chunk_map(pipe.fill()[0])[1] == (0, 64)


def test_a_decode_brings_the_budget_back_and_its_end_the_idle_budget() -> None:
    sched = create_scheduler(budget_tokens=64, idle_budget_tokens=512)
    pipe = FakePipeline(sched)
    add_request(sched, 1, prompt_len=10, max_tokens=3)
    pipe.fill()
    pipe.complete_oldest()  # 1 decodes now
    add_request(sched, 2, prompt_len=1000, max_tokens=1)
    beside_decode = pipe.fill()[0]
    assert chunk_map(beside_decode) == {1: (10, 1), 2: (0, 63)}  # the budget, decode first
    pipe.complete_oldest()
    assert chunk_map(pipe.fill()[0]) == {1: (11, 1), 2: (63, 63)}
    pipe.complete_oldest()  # 1's last token: nothing decodes any more
    assert chunk_map(pipe.fill()[0]) == {2: (126, 512)}


def test_while_idle_the_chunk_schedule_and_time_budget_do_not_shrink_chunks() -> None:
    """Both bound the time between tokens, and no one waits between tokens."""
    cost = StepCostModel(fixed_s=0.002, per_token_s=1e-3)
    sched = create_scheduler(
        budget_tokens=64,
        idle_budget_tokens=256,
        chunk_schedule=((0, 32),),
        time_budget_s=0.02,
        step_cost=cost,
    )
    pipe = FakePipeline(sched)
    add_request(sched, 1, prompt_len=300, max_tokens=4)
    assert chunk_map(pipe.fill()[0]) == {1: (0, 256)}
    pipe.complete_oldest()
    pipe.fill()
    pipe.complete_oldest()  # 1 decodes now
    add_request(sched, 2, prompt_len=300, max_tokens=1)
    # Beside a decode: the time budget (18 ms of tokens after the 2 ms fixed) and the schedule.
    assert chunk_map(pipe.fill()[0]) == {1: (300, 1), 2: (0, 17)}
