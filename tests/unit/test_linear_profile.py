"""The live-calibrated cost model: a fit recovers a known profile whose token cost is not one
slope, prompts and decodes are costed by their own terms, the turnaround holds the pipeline,
and a simulation runs on it."""

from __future__ import annotations

import numpy as np
import pytest
from sarathictl.bench.sim_run import SimSetup, prepare
from sarathictl.bench.workloads import WorkloadSpec

from controller.executor.simulated import SimulatedPipeline
from controller.scheduler import MicroBatch, ScheduledChunk
from controller.scheduler.step_cost import attended
from controller.simulator.linear_profile import (
    LinearProfile,
    StageCoefficients,
    fit_knots,
    fit_rows,
    knot_weights,
)

# Shaped like the CPU pipeline's: one token 10 ms, four 19 ms, then close to 1 ms a token.
KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TRUE = StageCoefficients(
    KNOTS,
    (0.010, 0.015, 0.019, 0.024, 0.030, 0.042, 0.071, 0.128, 0.240, 0.480),
    per_decode_s=0.0004,
    per_prefill_pair_s=2e-8,
    per_decode_key_s=1.5e-6,
)


def rows() -> list[tuple[int, int, int, int, float]]:
    """Lone prompts, decode groups and mixes at the knots and between them."""
    out = []
    for n in (1, 3, 16, 24, 32, 48, 64, 100, 128, 200, 256, 400, 512):
        out.append((n, 0, attended(0, n), 0, TRUE.stage_time_s(n, 0, attended(0, n), 0)))
    for d in (1, 2, 4, 6, 8, 12, 16):
        for context in (64, 400):
            keys = d * (context + 1)
            out.append((0, d, 0, keys, TRUE.stage_time_s(0, d, 0, keys)))
    for n, d in ((60, 4), (120, 8), (500, 12)):
        pairs, keys = attended(0, n), d * 200
        out.append((n, d, pairs, keys, TRUE.stage_time_s(n, d, pairs, keys)))
    return out


def test_fit_recovers_a_profile_that_one_slope_cannot_hold() -> None:
    fitted = fit_rows(rows())
    assert fitted.token_knots == KNOTS
    assert fitted.knot_s == pytest.approx(TRUE.knot_s, rel=1e-3)
    for name in ("per_decode_s", "per_prefill_pair_s", "per_decode_key_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-3), name
    # The point of the knots: a lone decode costs 10 ms, not the 1 ms a token of a long prompt.
    assert fitted.stage_time_s(0, 1, 0, 65) == pytest.approx(0.0105, rel=0.01)


def test_knots_without_data_between_their_neighbours_are_dropped() -> None:
    assert fit_knots([1, 4, 16, 64]) == (1, 4, 16, 64)
    assert fit_knots([1, 3, 5, 512]) == (1, 2, 4, 8, 512)  # 16-256 have nothing around them
    assert fit_knots([7]) == (7,)


def test_knot_weights_interpolate_and_extend_the_last_segment() -> None:
    assert knot_weights(3, (1, 2, 4)) == [0.0, 0.5, 0.5]
    assert knot_weights(1, (1, 2, 4)) == [1.0, 0.0, 0.0]
    # Past 4: its value and the 2-to-4 slope over 4 more tokens, twice that segment.
    assert knot_weights(8, (1, 2, 4)) == [0.0, -2.0, 3.0]
    assert TRUE.tokens_s(1024) == pytest.approx(0.480 + 512 * (0.480 - 0.240) / 256)


def test_prompt_chunks_and_decodes_are_costed_apart() -> None:
    profile = LinearProfile(TRUE, num_stages=2)
    chunk = ScheduledChunk(0, 0, 64, True, (), [0] * 64, None)
    decode = ScheduledChunk(1, 300, 1, True, (), [0], None)
    cost = profile.micro_batch_cost(MicroBatch(0, [chunk, decode], [], 65))
    expected = TRUE.stage_time_s(64, 1, attended(0, 64), 301)
    assert cost.stage_times_s == pytest.approx([expected, expected])


def test_the_turnaround_delays_each_result_and_so_the_next_plan() -> None:
    slow = LinearProfile(StageCoefficients((1,), (0.010,), turnaround_s=0.002), num_stages=2)
    pipeline = SimulatedPipeline(slow)
    decode = ScheduledChunk(1, 300, 1, True, (), [0], None)
    back_s = pipeline.submit(MicroBatch(1, [decode], [], 1), now=0.0)
    assert back_s == pytest.approx(0.010 + 0.010 + 0.002)
    assert pipeline.stage0_free_at_s == pytest.approx(0.010)  # the stages themselves are free


def test_bad_profiles_and_too_few_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="per_decode_s must be a finite number"):
        StageCoefficients((1,), (0.0,), per_decode_s=-1.0)
    with pytest.raises(ValueError, match=r"knot_s\[1\] must be a finite number"):
        StageCoefficients((1, 2), (0.0, np.nan))
    with pytest.raises(ValueError, match="token_knots must rise"):
        StageCoefficients((4, 2), (0.0, 0.0))
    with pytest.raises(ValueError, match="2 values for 1 knots"):
        StageCoefficients((1,), (0.0, 0.0))
    with pytest.raises(ValueError, match="at least 8 micro-batches"):
        fit_rows(rows()[:3])


def test_a_simulation_runs_on_the_calibrated_profile() -> None:
    workload = WorkloadSpec(source="fixed", num_requests=16, prompt_tokens=128, output_tokens=8)
    sim = prepare(SimSetup(pp=2, budget_tokens=64, workload=workload, stage_coefficients=TRUE))
    metrics = sim.run(1.0)
    assert metrics.num_requests == 16
    # A lone 128-token prompt in 64-token chunks: at least two chunks through two stages.
    assert metrics.ttft_p50_s >= 2 * TRUE.stage_time_s(64, 0, attended(0, 64), 0)
