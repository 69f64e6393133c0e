"""SLO mode (--tbt-slo): the budgets are chosen from the cost profile so that the predicted time
between tokens stays under the target, and status says what was chosen."""

from __future__ import annotations

import pytest
from sarathi_proto import generate_pb2

from controller.__main__ import build_parser, scheduler_config
from controller.scheduler import ConfigError
from controller.scheduler.step_cost import StepCostModel
from controller.slo import choose_for_tbt_slo
from tests.unit.test_status_render import rendered

# A stage of 10 ms plus 0.1 ms a token, attention 10 ns a (query, key) pair.
COST = StepCostModel(fixed_s=0.01, per_token_s=1e-4, per_attended_s=1e-8)


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("slo", [0.2, 0.5, 2.0])
def test_the_chosen_budget_keeps_the_predicted_tbt_under_the_slo(pp: int, slo: float) -> None:
    choice = choose_for_tbt_slo(slo, COST, pp, tile_tokens=32, context_tokens=2048)
    assert choice.budget_tokens % 32 == 0 and choice.budget_tokens >= 32
    assert choice.predicted_tbt_s <= 0.8 * slo
    one_tile_more = pp * (COST.fixed_s + COST.chunk_s(2048, choice.budget_tokens + 32))
    assert one_tile_more > 0.8 * slo or choice.budget_tokens == 16384  # the largest that fits
    # a round's decodes over the same context fit a micro-batch's time too
    per_micro_batch = -(-choice.max_num_seqs // pp)
    assert COST.fixed_s + COST.decodes_s(per_micro_batch, per_micro_batch * 2048) <= (
        choice.stage_time_s * 1.01
    )
    assert 1 <= choice.max_num_seqs <= choice.budget_tokens


def test_a_tighter_slo_or_a_deeper_pipeline_gives_a_smaller_budget() -> None:
    budgets = [choose_for_tbt_slo(s, COST, 1, 32, 2048).budget_tokens for s in (2.0, 0.5, 0.2)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    assert choose_for_tbt_slo(0.5, COST, 4, 32, 2048).budget_tokens < budgets[1]


def test_an_unreachable_slo_says_what_one_tile_takes() -> None:
    with pytest.raises(ConfigError, match=r"tbt_slo.*one tile of 32 tokens"):
        choose_for_tbt_slo(0.02, COST, 2, 32, 2048)


def controller_args(*extra: str) -> list[str]:
    return ["--model", "/m", "--max-model-len", "4096", "--pp", "2", *extra]


def test_the_controller_flags_set_the_scheduler_in_slo_mode() -> None:
    args = build_parser().parse_args(
        controller_args("--tbt-slo", "0.5", "--step-cost", "0.01,1e-4,1e-8")
    )
    config = scheduler_config(args, 4096)
    expected = choose_for_tbt_slo(0.5, COST, 2, 32, 4096)
    assert config.budget_tokens == expected.budget_tokens
    assert config.max_num_seqs == expected.max_num_seqs
    assert config.time_budget_s == pytest.approx(expected.stage_time_s)
    assert config.step_cost == COST and config.tbt_slo_s == 0.5


def test_time_budgets_need_a_step_cost_and_a_bad_one_is_named() -> None:
    for flags in (("--tbt-slo", "0.5"), ("--time-budget", "0.1")):
        with pytest.raises(ConfigError, match=flags[0][2:].replace("-", "_")):
            scheduler_config(build_parser().parse_args(controller_args(*flags)), 4096)
    bad = build_parser().parse_args(controller_args("--step-cost", "1,2"))
    with pytest.raises(ConfigError, match="step_cost"):
        scheduler_config(bad, 4096)
    plain = scheduler_config(build_parser().parse_args(controller_args()), 4096)
    assert (plain.budget_tokens, plain.time_budget_s, plain.step_cost) == (512, 0.0, None)


def test_status_says_what_slo_mode_chose() -> None:
    status = generate_pb2.StatusResponse(serving=True)
    status.scheduler.CopyFrom(
        generate_pb2.SchedulerStatus(
            policy="sarathi", budget_tokens=256, max_num_seqs=64, num_running=3,
            time_budget_s=0.2, tbt_slo_s=0.5,
        )
    )  # fmt: skip
    text = rendered(status)
    assert "budgets chosen for P99 TBT <= 500 ms" in text
    assert "256 / 200 ms" in text and "3/64" in text
