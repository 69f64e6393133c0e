"""validate.py's JSON lines as the markdown table in BENCHMARKS.md:
`python -m sarathictl.bench.validate_report validate.jsonl`."""

from __future__ import annotations

import json
import sys
from typing import Any


def _spread(s: dict[str, float], scale: float, fmt: str) -> str:
    return f"{s['median'] * scale:{fmt}} ({s['min'] * scale:{fmt}}-{s['max'] * scale:{fmt}})"


def _error(sim: float, live: float) -> str:
    return f"{(sim - live) / live:+.0%}" if live else "-"


def capacity_verdict(live: dict[str, Any]) -> str:
    """Within the tolerance when every probe below the prediction passed and every one above
    failed; otherwise which side missed."""
    below, above = all(live["below"]["passed"]), not any(live["above"]["passed"])
    if below and above:
        return "within"
    if not below:
        return "live lower"
    return "live higher"


def _profile_error(live: dict[str, Any]) -> str:
    """The calibrated profile against the micro-batches this policy ran live at the fixed rate:
    median (90th percentile) of |relative error| of a stage's time."""
    error = live.get("profile_error")
    return f"{error['median']:.0%} ({error['p90']:.0%})" if error else "-"


def probe_cell(r: dict[str, Any], name: str) -> str:
    """`rate: verdict (P99 TBT ms, median scheduling delay s; each live / simulated)` of one
    capacity probe: the two figures the SLO rule reads."""
    probe = r["live"][name]
    verdicts = "/".join("pass" if p else "fail" for p in probe["passed"])
    live_tbt = "/".join(f"{t * 1e3:.0f}" for t in probe["tbt_p99_s"])
    live_delay = "/".join(f"{d:.2f}" for d in probe["delay_p50_s"])
    sim = r.get("simulated_probes", {}).get(name)
    sim_tbt = f" / {sim['tbt_p99_s'] * 1e3:.0f}" if sim else ""
    sim_delay = f" / {sim['scheduling_delay_p50_s']:.2f}" if sim else ""
    return f"{probe['qps']:.3f}: {verdicts} ({live_tbt}{sim_tbt} ms, {live_delay}{sim_delay} s)"


def rows(report: dict[str, Any]) -> list[str]:
    out = []
    for policy in ("sarathi", "vllm", "orca"):
        if policy not in report:
            continue
        r = report[policy]
        sim, live = r["simulated"], r["live"]
        fixed = live["fixed"]
        out.append(
            f"| {report['trace']} x{report['scale']:g} | {report['pp']} | {policy} | "
            f"{r['predicted_capacity_qps']:.3f} | {probe_cell(r, 'below')}; "
            f"{probe_cell(r, 'above')} | "
            f"{capacity_verdict(live)} | {sim['tbt_p99_s'] * 1e3:.0f} | "
            f"{_spread(fixed['tbt_p99_s'], 1e3, '.0f')} | "
            f"{_error(sim['tbt_p99_s'], fixed['tbt_p99_s']['median'])} | "
            f"{sim['ttft_p50_s'] * 1e3:.0f} | {_spread(fixed['ttft_p50_s'], 1e3, '.0f')} | "
            f"{sim['bubble_fraction']:.0%} | {_spread(fixed['bubble_fraction'], 100, '.0f')}% | "
            f"{_profile_error(live)} |"
        )
    return out


HEADER = (
    "| workload | PP | policy | predicted capacity req/s | live probes (rate: verdict (P99 TBT, "
    "median scheduling delay; live / sim)) | "
    "capacity | P99 TBT ms sim | live median (range) | error | TTFT p50 ms sim | live median "
    "(range) | bubble sim | live median (range) | profile error on live steps |\n"
    "| --- | ---: | --- | ---: | --- | --- " + "| ---: " * 8 + "|"
)


def main(path: str) -> int:
    print(HEADER)
    latest: dict[tuple[str, float, int], dict[str, Any]] = {}
    with open(path) as f:  # a configuration's last line holds every policy measured so far
        for line in f:
            report = json.loads(line)
            latest[(report["trace"], report["scale"], report["pp"])] = report
    for report in latest.values():
        for row in rows(report):
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
