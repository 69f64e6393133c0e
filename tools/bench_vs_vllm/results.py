"""From the JSON files `vllm bench serve --save-result` writes to table rows, capacity under a
TBT SLO, and the Markdown report."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from bench_vs_vllm.ttft_split import TtftSplit, ttft_split_of

MAX_MEDIAN_TTFT_S = 2.0
"""The paper's bound on the median scheduling delay (section 5.1); TTFT stands in for it here
(it also holds the prompt's prefill, so the bound is stricter than the paper's)."""


@dataclass(frozen=True)
class Row:
    """One run: one system, one workload, one request rate."""

    system: str
    workload: str
    rate: float
    """Requests/s asked of the client; inf: every request at once."""
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    median_tpot_ms: float
    p99_tpot_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    median_itl_ms: float
    p99_itl_ms: float
    """Inter-token latency: every gap between two streamed tokens, the paper's TBT."""
    bubble_fraction: float = math.nan
    """The stages' bubble over the run (bubbles.py); NaN where the stages were not timed."""
    steady_bubble_fraction: float = math.nan
    """The same over the middle 80% of the arrivals."""
    steady_lone_fraction: float = math.nan
    """Of steady_bubble_fraction, the part with one request alone in the system (bubbles.py)."""
    ttft_split: TtftSplit | None = None
    """Median TTFT of the requests that arrived alone and of those beside others
    (ttft_split.py); None where the result has no per-request lists."""


def _number(result: dict[str, object], key: str) -> float:
    value = result.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def parse_result(result: dict[str, object], system: str, workload: str) -> Row:
    """A saved result (run with --percentile-metrics ttft,tpot,itl and --metric-percentiles
    50,99). A field it lacks becomes NaN; a result without its rate or request counts is not a
    `vllm bench serve` result at all."""
    for key in ("request_rate", "completed"):
        if key not in result:
            raise ValueError(f"not a vllm bench serve result: no {key!r}")
    asked = result["request_rate"]
    rate = math.inf if asked in ("inf", "Infinity") else _number(result, "request_rate")
    return Row(
        system=system,
        workload=workload,
        rate=rate,
        completed=int(_number(result, "completed")),
        failed=int(_number(result, "failed")) if "failed" in result else 0,
        duration_s=_number(result, "duration"),
        request_throughput=_number(result, "request_throughput"),
        output_throughput=_number(result, "output_throughput"),
        median_tpot_ms=_number(result, "median_tpot_ms"),
        p99_tpot_ms=_number(result, "p99_tpot_ms"),
        median_ttft_ms=_number(result, "median_ttft_ms"),
        p99_ttft_ms=_number(result, "p99_ttft_ms"),
        median_itl_ms=_number(result, "median_itl_ms"),
        p99_itl_ms=_number(result, "p99_itl_ms"),
        ttft_split=ttft_split_of(result),
    )


def row_from_summary(saved: dict[str, object]) -> Row:
    """A row as summary.json holds it (the rate as the client's flag, "inf" for all at once)."""
    fields = dict(saved)
    rate = str(fields.pop("rate"))
    split = fields.pop("ttft_split", None)
    return Row(
        **fields,  # type: ignore[arg-type]
        rate=math.inf if rate == "inf" else float(rate),
        ttft_split=TtftSplit(**split) if isinstance(split, dict) else None,
    )


def stages_path(result: Path) -> Path:
    """Where a run's stage measurement is saved beside its result (bubbles.py)."""
    return result.with_suffix(".stages.json")


def load_row(path: Path, system: str, workload: str) -> Row:
    """A saved run, with its bubbles where its stages were timed."""
    row = parse_result(json.loads(path.read_text()), system, workload)
    stages = stages_path(path)
    if not stages.is_file():
        return row
    saved = json.loads(stages.read_text())
    return replace(
        row,
        bubble_fraction=_number(saved, "bubble_fraction"),
        steady_bubble_fraction=_number(saved, "steady_bubble_fraction"),
        steady_lone_fraction=_number(saved, "steady_lone_fraction"),
    )


def passes_slo(row: Row, tbt_slo_ms: float, max_median_ttft_s: float = MAX_MEDIAN_TTFT_S) -> bool:
    """P99 TBT within the SLO, median TTFT within its bound, and no request failed."""
    return (
        row.failed == 0
        and row.completed > 0
        and row.p99_itl_ms <= tbt_slo_ms
        and row.median_ttft_ms <= max_median_ttft_s * 1000
    )


def capacity(
    rows: Iterable[Row], tbt_slo_ms: float, max_median_ttft_s: float = MAX_MEDIAN_TTFT_S
) -> float:
    """The highest finite rate that passes with every lower rate passing too (the paper assumes
    passing is monotone in the rate; a pass above a failure is noise, not capacity). 0 when the
    lowest rate fails. The `inf` run is a saturation point, not a rate, and is left out."""
    best = 0.0
    for row in sorted((r for r in rows if math.isfinite(r.rate)), key=lambda r: r.rate):
        if not passes_slo(row, tbt_slo_ms, max_median_ttft_s):
            break
        best = row.rate
    return best


def slo_from_light_load(rows: Iterable[Row], system: str, factor: float) -> float:
    """`factor` times the median TBT of `system` at its lowest finite rate: its decode step
    with (almost) no prefill beside it, the paper's base for a TBT SLO."""
    light = [r for r in rows if r.system == system and math.isfinite(r.rate)]
    if not light:
        raise ValueError(f"no finite-rate run of {system!r} to take the SLO from")
    lightest = min(light, key=lambda r: r.rate)
    if not math.isfinite(lightest.median_itl_ms):
        raise ValueError(f"{system!r} at {lightest.rate} req/s has no median ITL")
    return factor * lightest.median_itl_ms


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def markdown_table(rows: Iterable[Row]) -> str:
    """Rows grouped by workload, then rate, then system (so the two systems sit side by side)."""
    header = (
        "| workload | rate req/s | system | done | req/s | output tok/s | TPOT p50 ms | "
        "TPOT p99 ms | TTFT p50 ms | TTFT p99 ms | TBT (ITL) p99 ms |\n"
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    ordered = sorted(rows, key=lambda r: (r.workload, r.rate, r.system))
    lines = [
        f"| {r.workload} | {_rate(r.rate)} | {r.system} | {r.completed}"
        + (f" ({r.failed} failed)" if r.failed else "")
        + f" | {r.request_throughput:.2f} | {r.output_throughput:.1f} | {_ms(r.median_tpot_ms)} | "
        f"{_ms(r.p99_tpot_ms)} | {_ms(r.median_ttft_ms)} | {_ms(r.p99_ttft_ms)} | "
        f"{_ms(r.p99_itl_ms)} |"
        for r in ordered
    ]
    return "\n".join([header, *lines])


def capacity_table(
    rows: list[Row], slos_ms: dict[str, float], max_median_ttft_s: float = MAX_MEDIAN_TTFT_S
) -> str:
    """Capacity of every (workload, system) under every named SLO."""
    names = list(slos_ms)
    header = "| workload | system | " + " | ".join(
        f"capacity, {n} SLO ({slos_ms[n]:.0f} ms) req/s" for n in names
    )
    lines = [header + " |", "| --- | --- |" + " ---: |" * len(names)]
    for workload in sorted({r.workload for r in rows}):
        for system in sorted({r.system for r in rows}):
            mine = [r for r in rows if r.workload == workload and r.system == system]
            if not mine:
                continue
            cells = [f"{capacity(mine, slos_ms[n], max_median_ttft_s):g}" for n in names]
            lines.append(f"| {workload} | {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f}%"


def bubble_table(rows: Iterable[Row]) -> str:
    """The runs whose stages were timed: their bubble over the run and in the steady state
    ("" when none was)."""
    timed = sorted(
        (r for r in rows if not math.isnan(r.bubble_fraction)),
        key=lambda r: (r.workload, r.rate, r.system),
    )
    if not timed:
        return ""
    lines = [
        "| workload | rate req/s | system | bubble, whole run | bubble, steady state "
        "| of which a request alone |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r.workload} | {_rate(r.rate)} | {r.system} | {_pct(r.bubble_fraction)} | "
        f"{_pct(r.steady_bubble_fraction)} | {_pct(r.steady_lone_fraction)} |"
        for r in timed
    ]
    return "\n".join(lines)


def _ms_of(median_ms: float, count: int) -> str:
    return "-" if not count else f"{_ms(median_ms)} ({count})"


def ttft_split_table(rows: Iterable[Row]) -> str:
    """Median TTFT of the requests that arrived alone and of those beside others, with their
    counts, for the runs that spread their arrivals (not rate inf) ("" when none has them)."""
    split = sorted(
        (r for r in rows if r.ttft_split is not None and math.isfinite(r.rate)),
        key=lambda r: (r.workload, r.rate, r.system),
    )
    if not split:
        return ""
    lines = [
        "| workload | rate req/s | system | TTFT p50 ms, alone (n) "
        "| TTFT p50 ms, beside others (n) |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for r in split:
        t = r.ttft_split
        assert t is not None
        lines.append(
            f"| {r.workload} | {_rate(r.rate)} | {r.system} | {_ms_of(t.alone_ms, t.num_alone)} | "
            f"{_ms_of(t.beside_ms, t.num_beside)} |"
        )
    return "\n".join(lines)
