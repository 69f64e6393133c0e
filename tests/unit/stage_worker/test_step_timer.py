"""A worker's step phases: laps of one step are disjoint and add up to its step time; the
forward pass splits into linear layers, attention and the rest; timing changes no output."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from sarathi_proto import stage_pb2

from stage_worker.layers import linear
from stage_worker.runner import PreparedStep, StageRunner
from stage_worker.step_timer import StepTimer, TimedAttention, clock
from tests.unit.stage_worker.inprocess import make_runners


@pytest.fixture(autouse=True)
def linear_clock_off() -> Iterator[None]:
    yield
    linear.CLOCK.on = False  # a process-wide switch: leave it as the other tests expect


def prompt_plan(batch_id: int, seq_id: int, tokens: list[int]) -> stage_pb2.StepPlan:
    plan = stage_pb2.StepPlan(batch_id=batch_id)
    seq = plan.seqs.add(seq_id=seq_id, first_position=0, num_tokens=len(tokens), yields_token=True)
    seq.new_block_ids.extend(range(seq_id * 4, seq_id * 4 + -(-len(tokens) // 16)))
    seq.token_ids.extend(tokens)
    seq.sampling.CopyFrom(stage_pb2.SamplingParams(top_p=1.0))
    return plan


def timed_step(runner: StageRunner, timer: StepTimer, plan: stage_pb2.StepPlan) -> torch.Tensor:
    """One step of a single-stage pipeline, lapped as the worker loop laps it."""
    timer.begin(clock())
    step = runner.prepare(plan)
    timer.prepare_s += timer.lap()
    hidden = runner.forward(step, None)
    timer.forward_s += timer.lap()
    logits = runner.logits(step, hidden)
    timer.logits_s += timer.lap()
    runner.sample(step, logits)
    timer.sample_s += timer.lap()
    timer.end(step.meta.num_tokens)
    return logits


def test_phases_split_the_step_and_leave_its_output_alone(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    model_dir = tiny_checkpoint("llama")
    plain, timed = make_runners(model_dir, 1, 16)[0], make_runners(model_dir, 1, 16)[0]
    tokens = [(7 * i) % 200 + 1 for i in range(20)]
    expected = plain.logits(*_forward(plain, prompt_plan(1, 0, tokens)))
    # The linear layers' clock is process-wide (one runner per worker): start it after `plain`.
    timed.attention = TimedAttention(timed.attention)
    timer = StepTimer(timed.attention)
    got = timed_step(timed, timer, prompt_plan(1, 0, tokens))
    assert torch.equal(got, expected)

    totals = timer.totals()
    assert totals.num_steps == 1 and totals.num_tokens == 20
    assert totals.linear_s > 0 and totals.attention_s > 0 and totals.forward_other_s > 0
    assert totals.linear_s + totals.attention_s + totals.forward_other_s == pytest.approx(
        timer.forward_s
    )
    parts = (
        totals.prepare_s + totals.linear_s + totals.attention_s + totals.forward_other_s
        + totals.logits_s + totals.sample_s
    )  # fmt: skip
    assert 0 < parts <= totals.step_s * (1 + 1e-9)


def _forward(runner: StageRunner, plan: stage_pb2.StepPlan) -> tuple[PreparedStep, torch.Tensor]:
    step = runner.prepare(plan)
    return step, runner.forward(step, None)


def test_without_a_timed_backend_the_forward_is_reported_whole() -> None:
    timer = StepTimer(None)  # as on CUDA
    assert not linear.CLOCK.on
    timer.begin(clock())
    timer.forward_s += 0.5
    timer.end(4)
    totals = timer.totals()
    assert totals.linear_s == totals.attention_s == 0.0
    assert totals.forward_other_s == 0.5
