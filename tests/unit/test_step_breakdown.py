"""`bench step-breakdown`'s arithmetic and output, from Status readings made up here: per-step
differences of the phase totals, the client's TPOT over the window, vLLM's TPOT beside ours."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
from sarathi_proto import generate_pb2
from sarathictl.bench.breakdown import (
    CONTROLLER_PHASES,
    STAGE_PHASES,
    scenario_breakdown,
    totals_of,
)
from sarathictl.bench.breakdown_load import Scenario, window_tpot_s
from sarathictl.bench.breakdown_report import as_json, markdown, read_vllm_summary, table_rows
from sarathictl.bench.step_breakdown import scenarios_of
from sarathictl.cli import main


def reading(uptime_s: float, results: int, steps: int, scale: float) -> generate_pb2.StatusResponse:
    """A Status whose every phase total is `scale` seconds per step (stages: per phase)."""
    status = generate_pb2.StatusResponse(uptime_s=uptime_s)
    c = status.controller_phases
    c.num_results, c.num_tokens = results, 4 * results
    for name, _ in CONTROLLER_PHASES:
        setattr(c, name, scale * results)
    c.round_trip_s = 10 * scale * results
    for _ in range(2):
        p = status.stages.add().phases
        p.num_steps, p.num_tokens = steps, 4 * steps
        for name, _ in STAGE_PHASES:
            setattr(p, name, scale * steps)
        p.step_s = len(STAGE_PHASES) * scale * steps
    return status


def test_each_phase_is_the_difference_of_its_totals_per_step() -> None:
    before = totals_of(reading(uptime_s=100.0, results=50, steps=50, scale=0.001))
    after = totals_of(reading(uptime_s=100.5, results=60, steps=60, scale=0.001))
    result = scenario_breakdown("batch 8", 8, before, after, client_tpot_ms=95.0)
    c = result.controller
    assert c.steps == 10 and c.tokens_per_step == 4.0
    assert all(v == pytest.approx(1.0) for v in c.phases_ms.values())  # 1 ms each
    assert c.wall_ms == pytest.approx(50.0) and c.round_trip_ms == pytest.approx(10.0)
    assert c.other_ms == pytest.approx(50.0 - len(CONTROLLER_PHASES))
    for stage in result.stages:
        assert stage.steps == 10 and stage.tokens_per_step == 4.0
        assert stage.step_ms == pytest.approx(len(STAGE_PHASES))
        assert stage.unaccounted_ms == pytest.approx(0.0, abs=1e-9)
        assert stage.idle_ms == pytest.approx(50.0 - len(STAGE_PHASES))


def test_a_window_without_steps_is_refused_naming_the_scenario() -> None:
    same = totals_of(reading(uptime_s=1.0, results=5, steps=5, scale=0.001))
    with pytest.raises(ValueError, match="scenario mixed: controller: 0 micro-batch results"):
        scenario_breakdown("mixed", 8, same, same, 1.0)


def test_the_table_has_a_row_per_phase_and_a_column_per_scenario() -> None:
    before = totals_of(reading(1.0, 0, 0, 0.001))
    after = totals_of(reading(2.0, 10, 10, 0.001))
    results = [scenario_breakdown(label, 1, before, after, 40.0) for label in ("a", "b")]
    labels = [label for label, _ in table_rows(results)]
    for _, phase in CONTROLLER_PHASES:
        assert f"controller: {phase}" in labels
    for stage in (0, 1):
        for _, phase in STAGE_PHASES:
            assert f"stage {stage}: {phase}" in labels
    text = markdown("title", results, [])
    assert "| ms per micro-batch | a | b |" in text
    assert "| client TPOT (median over requests) | 40.0 | 40.0 |" in text
    assert "vLLM median TPOT: not measured" in text
    document = json.loads(json.dumps(as_json(results, [])))
    assert document["vllm_tpot"] == "not measured"
    assert document["scenarios"][0]["stages"][1]["phases_ms"]["linear_s"] == pytest.approx(1.0)


def test_vllm_tpot_comes_from_the_bench_vs_vllm_summary(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    rows = [
        {"system": "vllm", "workload": "random", "rate": rate, "median_tpot_ms": tpot}
        for rate, tpot in (("inf", 43.4), ("0.5", 24.4), ("0.25", 22.1))
    ] + [{"system": "sarathi", "workload": "random", "rate": "0.25", "median_tpot_ms": 52.3}]
    summary.write_text(json.dumps({"num_prompts": 12, "rows": rows}))
    found = read_vllm_summary(summary)
    assert [(v.what, v.median_tpot_ms) for v in found] == [
        ("random at 0.25 req/s", 22.1),
        ("random with all 12 requests at once", 43.4),
    ]
    assert read_vllm_summary(tmp_path / "missing.json") == []
    summary.write_text("{}")
    with pytest.raises(ValueError, match="not a bench-vs-vllm summary"):
        read_vllm_summary(summary)


def test_client_tpot_is_the_median_of_each_requests_mean_gap_in_the_window() -> None:
    times = [[0.0, 1.0, 2.0, 3.0, 9.0], [0.5, 1.5, 3.5], [0.0]]
    # in [1, 3.5]: request 0 has 1, 2, 3 (mean gap 1.0); request 1 has 1.5, 3.5 (2.0)
    assert window_tpot_s(times, 1.0, 3.5) == 1.5
    assert math.isnan(window_tpot_s(times, 20.0, 30.0))


def test_scenarios_come_from_the_flags_and_bad_ones_are_named() -> None:
    args = argparse.Namespace(
        batches=(1, 8), mixed_decodes=4, mixed_prompt_tokens=256, mixed_streams=2,
        prompt_tokens=16, warmup_tokens=4, window_tokens=32,
    )  # fmt: skip
    scenarios = scenarios_of(args)
    assert [s.label for s in scenarios] == ["batch 1", "batch 8", "mixed 4 + 256-token prompts"]
    assert scenarios[-1].prefill_streams == 2
    # batch 1 of 16 tokens at budget 64: one micro-batch's head start, then 4 + 32 + the tail
    assert scenarios[0].max_tokens_at(64) == 2 + 40
    # 8 prompts of 16 tokens, 56 prompt tokens a micro-batch: 3 + 8 micro-batches ahead
    assert scenarios[1].max_tokens_at(64) == 11 + 40
    with pytest.raises(ValueError, match="window_tokens=0"):
        Scenario("x", 1, 16, 4, 0)
    args.batches, args.mixed_decodes = (), 0
    with pytest.raises(ValueError, match="no scenario"):
        scenarios_of(args)


def test_the_command_refuses_more_requests_than_the_budget_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    code = main(
        ["bench", "step-breakdown", "--model", str(tmp_path), "--budget", "16", "--batches", "32"]
    )
    assert code == 2
    assert "--budget >= 32" in capsys.readouterr().err
