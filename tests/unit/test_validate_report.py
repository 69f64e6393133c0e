"""The simulator-against-live table: the capacity verdict follows the probes, and each probe shows
its live and simulated P99 TBT and median scheduling delay."""

from __future__ import annotations

from typing import Any

from sarathictl.bench.validate_report import capacity_verdict, rows


def policy_report(below: list[bool], above: list[bool], probes: bool = True) -> dict[str, Any]:
    spread = {"median": 0.2, "min": 0.19, "max": 0.22}
    sim = {"tbt_p99_s": 0.18, "ttft_p50_s": 0.4, "bubble_fraction": 0.25,
           "scheduling_delay_p50_s": 1.5}  # fmt: skip
    report: dict[str, Any] = {
        "predicted_capacity_qps": 1.0,
        "simulated": sim,
        "live": {
            "fixed": {"tbt_p99_s": spread, "ttft_p50_s": spread, "bubble_fraction": spread},
            "below": {"qps": 0.85, "passed": below, "tbt_p99_s": [0.15], "delay_p50_s": [1.25]},
            "above": {"qps": 1.15, "passed": above, "tbt_p99_s": [0.3], "delay_p50_s": [2.5]},
            "profile_error": {"median": 0.04, "p90": 0.12},
        },
    }
    if probes:
        report["simulated_probes"] = {"below": sim, "above": sim | {"scheduling_delay_p50_s": 2.25}}
    return report


def test_the_verdict_names_the_side_that_missed() -> None:
    assert capacity_verdict(policy_report([True], [False])["live"]) == "within"
    assert capacity_verdict(policy_report([False], [False])["live"]) == "live lower"
    assert capacity_verdict(policy_report([True], [True])["live"]) == "live higher"


def test_a_row_shows_both_probes_delays_the_errors_and_the_profile_error() -> None:
    line = {"trace": "splitwise", "scale": 0.25, "pp": 2, "vllm": policy_report([True], [False])}
    (row,) = rows(line)
    assert (
        "0.850: pass (150 / 180 ms, 1.25 / 1.50 s); 1.150: fail (300 / 180 ms, 2.50 / 2.25 s)"
        in row
    )
    assert "| within |" in row
    assert "| -10% |" in row  # P99 TBT 180 ms simulated against 200 live
    assert row.endswith("| 4% (12%) |")
    older = {"trace": "arxiv", "scale": 0.1, "pp": 1, "orca": policy_report([True], [True], False)}
    assert (
        "0.850: pass (150 ms, 1.25 s)" in rows(older)[0]
    )  # lines from before probes were simulated
