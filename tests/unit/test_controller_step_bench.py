"""`sarathictl bench controller-step` runs the controller's whole step against the stand-in
worker, and the stand-in answers every yielding sequence of a plan, decode columns included."""

from __future__ import annotations

import json

import pytest
from sarathi_proto import stage_pb2
from sarathictl.bench.controller_step import yielding_seq_ids
from sarathictl.cli import main


def test_the_bench_reports_each_point_with_its_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "controller-step", "--num-seqs", "8,1024", "--steps", "5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["decodes"], r["target_ms"]) for r in rows] == [(8, None), (1024, 1.0)]
    assert all(0 < r["critical_median_ms"] < r["median_ms"] <= r["p90_ms"] for r in rows)


def test_the_stand_in_answers_in_plan_order_around_the_decode_columns() -> None:
    plan = stage_pb2.StepPlan(batch_id=3, decodes_at=1)
    plan.seqs.add(seq_id=5, num_tokens=4, yields_token=True)
    plan.seqs.add(seq_id=6, num_tokens=4, yields_token=False)  # a chunk mid-prompt
    plan.seqs.add(seq_id=7, num_tokens=2, yields_token=True)
    plan.decodes.seq_ids.extend([1, 2, 3])
    assert yielding_seq_ids(plan) == [5, 1, 2, 3, 7]
