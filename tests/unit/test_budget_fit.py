"""The token budget fitted to the machine's measured steps: the line through a lone request's
TTFT and TPOT, the paper's strict SLO (5x a decode step of a batch of 32) predicted from it, and
the largest budget whose PP steps, times a P99 gap's measured excess over a step, fit it. What `up`
then runs is in test_layout_file.py."""

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


# Session 28's medians on the Zen 5 EPYC in bf16 (a 256-token lone prompt in one step): the
# figures with the faster decode, after which the older rule (5x a lone decode step) fitted 64.
ZEN5_BF16_FASTER = (83.5, 8.2)


@pytest.mark.parametrize(
    ("figures", "pp", "budget"),
    [
        (ZEN5_BF16, 1, 160),
        (ZEN5_BF16, 2, 64),
        (ZEN5_BF16_FASTER, 1, 160),
        (ZEN5_BF16_FASTER, 2, 64),
        (ZEN5_FLOAT32, 1, 128),
        (ZEN1_FLOAT32, 1, 96),
        ((20.0, 12.0), 1, 512),
    ],
    ids=[
        "zen5-bf16",
        "zen5-bf16-pp2",
        "zen5-bf16-faster",
        "zen5-bf16-faster-pp2",
        "zen5-float32",
        "zen1-float32",
        "cheap-tokens",
    ],
)
def test_the_budget_is_the_largest_whose_p99_gap_stays_within_the_strict_slo(
    figures: tuple[float, float], pp: int, budget: int
) -> None:
    fit = fit_steps(*figures, prompt_tokens=256, chunk_tokens=512)
    assert fit is not None
    assert fitted_budget(fit, pp) == budget
    # the strict SLO: 5x a decode step of 32, that step predicted as 32 tokens of the line
    slo_ms = 5 * (fit.fixed_ms + 32 * fit.per_token_ms)
    assert fit.strict_tbt_slo_ms() == pytest.approx(slo_ms)
    limit_ms = slo_ms / 1.5 / pp  # a P99 gap is up to 1.5 predicted steps (budget_fit.py)
    assert 1.5 * pp * fit.step_ms(budget) <= slo_ms
    larger = [b for b in BUDGET_CHOICES if b > budget]
    assert all(fit.step_ms(b) > limit_ms for b in larger)


def test_a_faster_decode_does_not_shrink_the_budget_below_a_batch_of_32_s_worth() -> None:
    """The rule's point: the SLO's unit is a batch of 32's step, not our lone decode's, so a
    cheaper fixed cost leaves the budget at least 96 tokens at PP=1 and 32 at PP=2."""
    for fixed_ms in (0.0, 0.5, 2.0, 8.0):
        fit = StepFit(fixed_ms=fixed_ms, per_token_ms=0.3)
        for pp, least in ((1, 96), (2, 32)):
            budget = fitted_budget(fit, pp)
            assert budget >= least
            assert fit.step_ms(budget) <= fit.stage_limit_ms(pp)  # fitted, not the fallback
    free = StepFit(fixed_ms=0.0, per_token_ms=0.3)  # no fixed cost at all: the bounds exactly
    assert (fitted_budget(free, 1), fitted_budget(free, 2)) == (96, 32)
    # and a dearer fixed cost lets more tokens share it
    assert fitted_budget(StepFit(30.0, 0.3), 1) > fitted_budget(StepFit(3.0, 0.3), 1)


def test_every_budget_choice_is_one_the_scheduler_and_up_s_idle_budget_take() -> None:
    tile = SchedulerConfig().tile_tokens
    assert all(b % tile == 0 for b in BUDGET_CHOICES)
    assert BUDGET_CHOICES[0] == tile
    assert max(BUDGET_CHOICES) <= layout_choice.IDLE_BUDGET_TOKENS  # idle >= budget
