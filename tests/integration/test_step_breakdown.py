"""`sarathictl bench step-breakdown` on a live local cluster (PP=2, a tiny random model): what a
user reads off it holds together. Every phase is there and none is negative, a stage's phases
fit in its step, a `batch N` micro-batch really holds the N decodes (spread over the PP
micro-batches in flight), the mixed one holds prompt tokens beside them."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest
from sarathictl.bench.breakdown import CONTROLLER_PHASES, STAGE_PHASES
from sarathictl.cli import main

from tests.integration.cluster_factories import make_tiny_served_model

pytestmark = pytest.mark.integration

PP = 2
BATCHES = (1, 4)
MIXED_DECODES = 2


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")
    capture = tmp_path_factory.mktemp("out") / "report.json"
    args = [
        "bench", "step-breakdown", "--model", str(model_dir), "--pp", str(PP),
        "--dtype", "float32", "--kv-cache-mb", "16", "--batches", ",".join(map(str, BATCHES)),
        "--mixed-decodes", str(MIXED_DECODES), "--mixed-prompt-tokens", "96",
        "--window-tokens", "12", "--vllm-summary", str(capture.parent / "none.json"), "--json",
    ]  # fmt: skip
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(args) == 0
    document: dict[str, Any] = json.loads(stdout.getvalue())
    return document


def test_every_scenario_reports_every_phase_none_negative(report: dict[str, Any]) -> None:
    labels = [s["label"] for s in report["scenarios"]]
    assert labels == [f"batch {n}" for n in BATCHES] + [f"mixed {MIXED_DECODES} + 96-token prompts"]
    for scenario in report["scenarios"]:
        controller = scenario["controller"]
        assert set(controller["phases_ms"]) == {name for name, _ in CONTROLLER_PHASES}
        assert all(v >= 0 for v in controller["phases_ms"].values()), scenario["label"]
        assert controller["other_ms"] >= 0 and controller["round_trip_ms"] > 0
        assert len(scenario["stages"]) == PP
        for stage in scenario["stages"]:
            assert set(stage["phases_ms"]) == {name for name, _ in STAGE_PHASES}
            assert all(v >= 0 for v in stage["phases_ms"].values()), scenario["label"]
        assert scenario["client_tpot_ms"] > 0
    assert report["vllm_tpot"] == "not measured"


def test_a_stages_phases_fit_in_its_measured_step(report: dict[str, Any]) -> None:
    for scenario in report["scenarios"]:
        for index, stage in enumerate(scenario["stages"]):
            phases = stage["phases_ms"]
            assert sum(phases.values()) <= stage["step_ms"] * 1.01 + 1e-3, (scenario, index)
            # the forward pass is split on the CPU, and only the last stage samples
            assert phases["linear_s"] > 0 and phases["attention_s"] > 0
            assert (phases["logits_s"] > 0) == (index == PP - 1)
            assert (phases["recv_wait_s"] > 0) == (index > 0)


def test_a_batch_column_holds_the_asked_decodes(report: dict[str, Any]) -> None:
    by_label = {s["label"]: s for s in report["scenarios"]}
    for n in BATCHES:
        scenario = by_label[f"batch {n}"]
        # Decodes are spread over the micro-batches in flight; one sequence is in one at a time.
        expected = n / min(n, PP)
        for stage in scenario["stages"]:
            assert stage["tokens_per_step"] == pytest.approx(expected, rel=0.1), n
        assert scenario["controller"]["tokens_per_step"] == pytest.approx(expected, rel=0.1)
    mixed = report["scenarios"][-1]
    # prompt chunks beside the decodes: well over the decodes' share of a micro-batch
    assert mixed["stages"][0]["tokens_per_step"] > 2 * MIXED_DECODES
