"""The time budget's cost model fitted to a stage cost model: exact on a linear one, close to the
analytic model where the scheduler works, and usable from `bench simulate`."""

from __future__ import annotations

import json

import pytest
from sarathictl.bench.sim_run import SimSetup, prepare
from sarathictl.bench.workloads import WorkloadSpec
from sarathictl.cli import main

from controller.scheduler import MicroBatch
from controller.scheduler.step_cost import attended
from controller.simulator import StageCost
from controller.simulator.step_cost_fit import _batch, fit_step_cost


class LinearStage:
    def micro_batch_cost(self, batch: MicroBatch) -> StageCost:
        pairs = sum(attended(c.first_position, c.num_tokens) for c in batch.chunks)
        return StageCost([0.01 + 2e-4 * batch.num_tokens + 3e-8 * pairs] * 2, 0.0)


def test_a_linear_stage_is_fitted_exactly() -> None:
    cost = fit_step_cost(LinearStage(), max_tokens=512, max_context=4096)
    assert (cost.fixed_s, cost.per_token_s, cost.per_attended_s) == pytest.approx(
        (0.01, 2e-4, 3e-8), rel=1e-6
    )


def test_the_fit_predicts_the_analytic_model_where_the_scheduler_works() -> None:
    setup = SimSetup(
        model="falcon-180b", gpu="a100", tp=4, pp=2, link="eth-100g", budget_tokens=512,
        workload=WorkloadSpec(source="sharegpt-paper", num_requests=16), time_budget="auto",
    )  # fmt: skip
    sim = prepare(setup)
    cost = sim.scheduler_config.step_cost
    assert cost is not None and cost.per_attended_s > 0  # attention is not free
    # what --budget tokens of a first chunk take
    assert sim.scheduler_config.time_budget_s == pytest.approx(cost.fixed_s + cost.chunk_s(0, 512))
    for chunks in ([(0, 512)], [(3000, 512)], [(1000, 1)] * 64 + [(0, 448)]):
        batch = _batch(chunks)
        truth = max(sim.cost_model.micro_batch_cost(batch).stage_times_s)
        predicted = cost.fixed_s + sum(cost.chunk_s(p, n) for p, n in chunks)
        assert predicted == pytest.approx(truth, rel=0.15)


def test_bench_simulate_takes_a_time_budget(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "simulate", "--model", "mistral-7b", "--num-requests", "32", "--qps", "2"]
    assert main([*argv, "--time-budget", "auto", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"]["num_requests"] == 32
    assert main([*argv, "--time-budget", "-1"]) == 2  # 0 (the default) is off
    assert "--time-budget" in capsys.readouterr().err
