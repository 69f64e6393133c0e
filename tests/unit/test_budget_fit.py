"""PP=1's token budget fitted to the machine's measured steps: the line through a lone request's
TTFT and TPOT, and the largest budget whose step stays within the strict SLO's 5 decode steps.
What `up` then runs is in test_layout_file.py."""

from __future__ import annotations

import pytest
from sarathictl import layout_choice
from sarathictl.budget_fit import BUDGET_CHOICES, StepFit, fit_steps, fitted_budget

from controller.scheduler.config import SchedulerConfig

# Session 26's medians on the Zen 5 EPYC (BENCHMARKS.md), bf16 and float32 at PP=1, and session
# 23's on the Zen 1 EPYC (float32): a 256-token lone prompt in one step, then its decodes.
ZEN5_BF16 = (121.3, 14.6)
ZEN5_FLOAT32 = (268.6, 11.6)
ZEN1_FLOAT32 = (828.0, 19.1)


def test_the_line_through_the_lone_request_recovers_the_step_cost() -> None:
    line = StepFit(fixed_ms=10.0, per_token_ms=0.5)
    tpot = line.step_ms(1)
    one_step = fit_steps(line.step_ms(256), tpot, prompt_tokens=256, chunk_tokens=512)
    assert one_step == pytest.approx(line)
    two_steps = fit_steps(2 * line.fixed_ms + 256 * 0.5, tpot, prompt_tokens=256, chunk_tokens=128)
    assert two_steps == pytest.approx(line)


@pytest.mark.parametrize(
    ("ttft_ms", "tpot_ms", "prompt_tokens"),
    [(10.0, 14.6, 256), (14.6, 14.6, 256), (121.3, 14.6, 1), (121.3, 14.6, 0), (30.0, 0.01, 256)],
    ids=["ttft-below-a-decode", "flat", "one-token", "no-prompt", "negative-fixed-cost"],
)
def test_figures_that_admit_no_line_give_no_fit(
    ttft_ms: float, tpot_ms: float, prompt_tokens: int
) -> None:
    assert fit_steps(ttft_ms, tpot_ms, prompt_tokens, chunk_tokens=512) is None


@pytest.mark.parametrize(
    ("figures", "budget"),
    [
        (ZEN5_BF16, 128),
        (ZEN5_FLOAT32, 32),
        (ZEN1_FLOAT32, 32),
        (
            (
                20.0,
                12.0,
            ),
            512,
        ),
    ],
    ids=["zen5-bf16", "zen5-float32", "zen1-float32", "cheap-tokens"],
)
def test_the_budget_is_the_largest_whose_step_stays_within_five_decode_steps(
    figures: tuple[float, ...], budget: int
) -> None:
    fit = fit_steps(*figures, prompt_tokens=256, chunk_tokens=512)
    assert fit is not None
    assert fitted_budget(fit) == budget
    limit_ms = 5 * fit.step_ms(1)
    assert fit.step_ms(budget) <= limit_ms or budget == BUDGET_CHOICES[0]
    larger = [b for b in BUDGET_CHOICES if b > budget]
    assert all(fit.step_ms(b) > limit_ms for b in larger)


def test_every_budget_choice_is_one_the_scheduler_and_up_s_idle_budget_take() -> None:
    tile = SchedulerConfig().tile_tokens
    assert all(b % tile == 0 for b in BUDGET_CHOICES)
    assert max(BUDGET_CHOICES) <= layout_choice.IDLE_BUDGET_TOKENS  # idle >= budget


@pytest.mark.parametrize(("one_stage", "pipeline"), [(32, 32), (64, 32), (128, 64), (512, 256)])
def test_a_pipeline_runs_half_the_one_stage_budget_and_never_under_the_tile(
    one_stage: int, pipeline: int
) -> None:
    assert layout_choice.pipeline_budget(one_stage) == pipeline
