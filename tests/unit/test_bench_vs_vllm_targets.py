"""Issue 30's targets read off a pass's runs (tools/bench_vs_vllm/targets.py): the verdicts a
CPU's column in README is written from."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))  # bench_vs_vllm is a folder there, not installed

from bench_vs_vllm.client import rate_flag
from bench_vs_vllm.results import Row
from bench_vs_vllm.targets import TARGETS, main, targets_table, verdicts

STRICT_MS = 400.0
INF = math.inf


def run(
    system: str,
    rate: float,
    req_s: float = 1.0,
    p99_itl: float = 100.0,
    tpot: float = 50.0,
    p99_tpot: float = 80.0,
    ttft: float = 300.0,
    bubble: float = math.nan,
) -> Row:
    return Row(
        system=system,
        workload="random-512-128",
        rate=rate,
        completed=12,
        failed=0,
        duration_s=10.0,
        request_throughput=req_s,
        output_throughput=100 * req_s,
        median_tpot_ms=tpot,
        p99_tpot_ms=p99_tpot,
        median_ttft_ms=ttft,
        p99_ttft_ms=2 * ttft,
        median_itl_ms=tpot,
        p99_itl_ms=p99_itl,
        steady_bubble_fraction=bubble,
    )


def pass_rows() -> list[Row]:
    """vLLM misses the strict SLO from 0.5 req/s (P99 TBT 900 ms) and its pipeline everywhere;
    ours holds it to 1 req/s; vLLM's pipeline saturates higher than its single process."""
    return [
        run("vllm", 0.25, p99_tpot=90.0, tpot=60.0, ttft=250.0),
        run("vllm", 0.5, p99_itl=900.0, p99_tpot=120.0),
        run("vllm", 1.0, p99_itl=900.0, p99_tpot=150.0),
        run("vllm", INF, req_s=1.0, p99_itl=900.0, p99_tpot=150.0),
        run("vllm-pp2", 0.25, p99_itl=900.0, bubble=0.5),
        run("vllm-pp2", 1.0, p99_itl=900.0, bubble=0.5),
        run("vllm-pp2", INF, req_s=1.1, p99_itl=900.0),
        run("sarathi-pp1", 0.25, tpot=30.0, ttft=260.0),
        run("sarathi-pp1", 0.5),
        run("sarathi-pp1", 1.0),
        run("sarathi-pp1", INF, req_s=1.5),
        run("sarathi-pp2", 0.25, bubble=0.2),
        run("sarathi-pp2", 1.0, bubble=0.04),
        run("sarathi-pp2", INF, req_s=1.2),
    ]


def cells(rows: list[Row]) -> dict[str, str]:
    return {v.target: v.cell() for v in verdicts(rows, STRICT_MS)}


def test_each_target_is_read_against_the_right_systems() -> None:
    got = cells(pass_rows())
    # vLLM's best layout at saturation is its pipeline here (1.1 req/s): 1.5 / 1.1 = 1.36x.
    assert got[TARGETS[0]] == ("1.50 (sarathi-pp1) against 1.10 req/s (vllm-pp2): 1.36x: **met**")
    # Against the best layout, vllm-pp2 (P99 TPOT 80 ms at its three rates), not vllm (whose
    # 0.25 req/s alone asks, where ours' TTFT, 260 ms, is above its 250).
    assert got[TARGETS[1]] == "3 rates asked: TPOT as low at 3, TTFT at 3: **met**"
    assert got[TARGETS[2]] == "1 against 0.25 req/s (4.00x): **met**"  # vllm holds 0.25
    assert got[TARGETS[3]] == "1 req/s against none: **met**"
    assert got[TARGETS[4]] == "4.0% at 1 req/s (vLLM -pp 2's 50.0%): **met**"


def test_a_loss_is_called_a_miss_and_an_unrun_system_is_never_met() -> None:
    rows = [r for r in pass_rows() if r.system != "sarathi-pp2"]
    slow = [
        run("sarathi-pp1", INF, req_s=1.2) if r.system == "sarathi-pp1" and r.rate == INF else r
        for r in rows
    ]
    got = cells(slow)
    assert got[TARGETS[0]].endswith("1.09x: **missed**")
    assert got[TARGETS[3]] == "not run (sarathi-pp2 and vllm-pp2)"
    assert got[TARGETS[4]] == "not run (sarathi-pp2)"


def test_capacities_compare_as_a_ratio_and_neither_serving_is_a_miss() -> None:
    both = [run("vllm", 0.25), run("vllm", 0.5, p99_itl=900.0)]
    both += [run("sarathi", 0.25), run("sarathi", 0.5), run("sarathi", 1.0, p99_itl=900.0)]
    assert cells(both)[TARGETS[2]] == "0.5 against 0.25 req/s (2.00x): **met**"
    none = [run("vllm", 0.25, p99_itl=900.0), run("sarathi", 0.25, p99_itl=900.0)]
    assert cells(none)[TARGETS[2]] == "neither serves any rate run: **missed**"


def test_latency_asks_nothing_where_vllm_never_gets_under_100_ms() -> None:
    rows = [run("vllm", 0.25, p99_tpot=120.0), run("sarathi", 0.25, tpot=500.0)]
    assert cells(rows)[TARGETS[1]] == "vllm's P99 TPOT never under 100 ms: nothing asked"


def test_latency_is_missed_where_ours_is_slower_at_an_asked_rate() -> None:
    rows = [run("vllm", 0.25, tpot=40.0), run("sarathi", 0.25, tpot=50.0)]
    assert cells(rows)[TARGETS[1]] == "1 rate asked: TPOT as low at 0, TTFT at 1: **missed**"


def test_passes_sit_side_by_side_from_their_summaries(tmp_path: Path, capsys) -> None:
    folders = []
    for name in ("pass-a", "pass-b"):
        folder = tmp_path / name
        folder.mkdir()
        summary = {
            "slo_ms": {"strict (5x)": STRICT_MS, "relaxed (25x)": 5 * STRICT_MS},
            "rows": [{**asdict(r), "rate": rate_flag(r.rate)} for r in pass_rows()],
        }
        (folder / "summary.json").write_text(json.dumps(summary))
        folders.append(str(folder))
    assert main(folders) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0] == "| target | workload | pass-a | pass-b |"
    assert table.count("**met**") == 2 * 5
    assert main([str(tmp_path / "nowhere")]) == 2


def test_the_table_has_a_row_per_target_and_workload() -> None:
    table = targets_table([verdicts(pass_rows(), STRICT_MS)], ["only"])
    assert len(table.splitlines()) == 2 + len(TARGETS)
