"""Workloads users bring: CSV/JSONL traces with arrival times replayed, bursty and diurnal load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sarathictl.bench.arrivals import DIURNAL_RATES, RateCurve
from sarathictl.bench.sim_run import SimSetup, prepare
from sarathictl.bench.trace_files import read_trace_rows
from sarathictl.bench.workloads import (
    WorkloadSpec,
    default_arrival,
    make_requests,
    recorded_qps,
    unit_rate_requests,
)


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_trace_is_replayed_at_its_recorded_times(tmp_path: Path) -> None:
    rows = [
        {"arrival_s": 10.0 + t, "prompt_tokens": 100 + i, "output_tokens": 5}
        for i, t in enumerate([0.0, 0.5, 0.6, 3.0, 4.0])
    ]
    trace = write_jsonl(tmp_path / "t.jsonl", rows[::-1])  # out of order on purpose
    spec = WorkloadSpec(source=str(trace), arrival="replay", num_requests=100)
    assert recorded_qps(spec) == pytest.approx(4 / 4.0)
    at_recorded = make_requests(spec, recorded_qps(spec))
    assert [r.arrival_s for r in at_recorded] == pytest.approx([0.0, 0.5, 0.6, 3.0, 4.0])
    assert [r.num_prompt_tokens for r in at_recorded] == [100, 101, 102, 103, 104]
    doubled = make_requests(spec, 2.0)  # twice the rate: the same bursts, half the time
    assert [r.arrival_s for r in doubled] == pytest.approx([0.0, 0.25, 0.3, 1.5, 2.0])


def test_azure_style_csv_with_iso_timestamps(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:51.0000000,20,1\n"
    )
    rows = read_trace_rows(trace)
    assert rows.lengths == [(374, 44), (396, 109), (20, 1)]
    assert rows.arrivals_s == pytest.approx([0.0, 4.314579, 4.319409])
    assert default_arrival(str(trace)) == "replay"


def test_replay_needs_arrival_times_and_says_which_columns(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "lengths.jsonl", [{"prompt_tokens": 3, "output_tokens": 1}])
    assert default_arrival(str(trace)) == "poisson"
    with pytest.raises(ValueError, match=r"records no arrival times.*arrived_at"):
        unit_rate_requests(WorkloadSpec(source=str(trace), arrival="replay"))
    with pytest.raises(ValueError, match="needs a trace with arrival times"):
        unit_rate_requests(WorkloadSpec(source="sharegpt-paper", arrival="replay"))


def test_bad_jsonl_line_is_named(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"prompt_tokens": 3, "output_tokens": 1}\n{"prompt_tokens": "x"\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2: not JSON"):
        read_trace_rows(trace)


def test_shipped_splitwise_trace_replays_by_default() -> None:
    assert default_arrival("splitwise") == "replay"
    assert default_arrival("arxiv") == "poisson"
    spec = WorkloadSpec(source="splitwise", arrival="replay", num_requests=200)
    times = [t for t, _, _ in unit_rate_requests(spec)]
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] == pytest.approx(199.0)  # rescaled to a mean rate of 1


def test_rate_curve_keeps_the_mean_rate_and_shapes_the_load() -> None:
    curve = RateCurve((1.0, 3.0), period_s=100.0)
    flat = np.sort(np.random.default_rng(0).uniform(0, 10_000, 40_000))
    warped = curve.warp(flat)
    assert np.all(np.diff(warped) >= 0)
    assert warped[-1] == pytest.approx(flat[-1], rel=0.01)  # same mean rate over whole periods
    phase = warped % 100.0
    low, high = (phase < 50).sum(), (phase >= 50).sum()
    assert high / low == pytest.approx(3.0, rel=0.05)
    assert curve.rate_at(75.0) == pytest.approx(1.5)


def test_diurnal_workload_in_a_simulation() -> None:
    spec = WorkloadSpec(
        source="fixed",
        num_requests=400,
        prompt_tokens=64,
        output_tokens=4,
        rate_curve=DIURNAL_RATES,
        rate_period_s=200.0,
    )
    arrivals = np.array([r.arrival_s for r in make_requests(spec, 2.0)])
    hour = (arrivals % 200.0) / 200.0 * 24
    afternoon = ((hour >= 13) & (hour < 17)).sum()
    night = ((hour >= 1) & (hour < 5)).sum()
    assert afternoon > 2 * night
    metrics = prepare(SimSetup(workload=spec)).run(2.0)
    assert metrics.num_requests == 400
    assert 0 < metrics.peak_kv_usage <= 1


def test_bad_rate_curve_names_the_field() -> None:
    with pytest.raises(ValueError, match="rate_curve rates must be > 0"):
        WorkloadSpec(rate_curve=(1.0, 0.0))
    with pytest.raises(ValueError, match="rate_period_s must be > 0"):
        WorkloadSpec(rate_curve=(1.0,), rate_period_s=0.0)
