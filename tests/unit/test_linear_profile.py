"""The live-calibrated cost model: a fit recovers known coefficients, prompts and decodes are
costed by their own terms, and a simulation runs on it."""

from __future__ import annotations

import pytest
from sarathictl.bench.sim_run import SimSetup, prepare
from sarathictl.bench.workloads import WorkloadSpec

from controller.scheduler import MicroBatch, ScheduledChunk
from controller.scheduler.step_cost import attended
from controller.simulator.linear_profile import LinearProfile, StageCoefficients, fit_rows

TRUE = StageCoefficients(0.010, 0.0007, 0.0018, 1e-8, 1.7e-5)


def rows() -> list[tuple[int, int, int, int, float]]:
    out = []
    for n in (16, 32, 64, 128, 256):
        out.append((n, 0, attended(0, n), 0, TRUE.stage_time_s(n, 0, attended(0, n), 0) + 0.012))
    for d, k in ((1, 64), (4, 64), (16, 64), (8, 384)):
        keys = d * (k + 1)
        out.append((0, d, 0, keys, TRUE.stage_time_s(0, d, 0, keys)))
    return out


def test_fit_recovers_the_coefficients_and_the_first_token_overhead() -> None:
    data = rows()
    coefficients, first_token_s = fit_rows(data, [r[0] > 0 for r in data])
    for name, value in vars(TRUE).items():
        assert getattr(coefficients, name) == pytest.approx(value, rel=1e-3, abs=1e-10), name
    assert first_token_s == pytest.approx(0.012)


def test_prompt_chunks_and_decodes_are_costed_apart() -> None:
    profile = LinearProfile(TRUE, num_stages=2)
    chunk = ScheduledChunk(0, 0, 64, True, (), [0] * 64, None)
    decode = ScheduledChunk(1, 300, 1, True, (), [0], None)
    cost = profile.micro_batch_cost(MicroBatch(0, [chunk, decode], [], 65))
    expected = TRUE.stage_time_s(64, 1, attended(0, 64), 301)
    assert cost.stage_times_s == pytest.approx([expected, expected])


def test_bad_coefficients_and_too_few_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="per_decode_s must be a finite number"):
        StageCoefficients(0.0, 0.0, -1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="at least 5 rows"):
        fit_rows(rows()[:3])


def test_a_simulation_runs_on_the_calibrated_profile() -> None:
    workload = WorkloadSpec(source="fixed", num_requests=16, prompt_tokens=128, output_tokens=8)
    sim = prepare(SimSetup(pp=2, budget_tokens=64, workload=workload, stage_coefficients=TRUE))
    metrics = sim.run(1.0)
    assert metrics.num_requests == 16
    # A lone 128-token prompt in 64-token chunks: at least two chunks through two stages.
    assert metrics.ttft_p50_s >= 2 * TRUE.stage_time_s(64, 0, attended(0, 64), 0)
