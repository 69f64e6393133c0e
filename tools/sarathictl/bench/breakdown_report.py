"""`bench step-breakdown`'s output: one table (rows: phases, columns: scenarios, ms per
micro-batch) with the client's TPOT and vLLM's beside it, or the same as JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from sarathictl.bench.breakdown import CONTROLLER_PHASES, STAGE_PHASES, ScenarioBreakdown


@dataclass(frozen=True)
class VllmTpot:
    """vLLM's median TPOT from one run of `make bench-vs-vllm` (or given by hand)."""

    source: str
    what: str
    """The run it comes from, e.g. `random-512-128 at 0.25 req/s`."""
    median_tpot_ms: float


def ms(value: float) -> str:
    """Three significant figures or so: 123, 12.3, 1.23, 0.123; `-` for NaN."""
    if math.isnan(value):
        return "-"
    if abs(value) < 0.0005:
        return "0"  # no "-0.000" from a rounding error
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def table_rows(results: list[ScenarioBreakdown]) -> list[tuple[str, list[float]]]:
    """(label, one value per scenario) for every row of the table, in order."""
    rows: list[tuple[str, list[float]]] = [
        ("tokens per micro-batch (stage 0)", [r.stages[0].tokens_per_step for r in results]),
        ("client TPOT (median over requests)", [r.client_tpot_ms for r in results]),
        ("controller: wall time", [r.controller.wall_ms for r in results]),
    ]
    for name, label in CONTROLLER_PHASES:
        rows.append((f"controller: {label}", [r.controller.phases_ms[name] for r in results]))
    rows.append(
        ("controller: other (APIs, event loop, waiting)", [r.controller.other_ms for r in results])
    )
    rows.append(
        (
            "controller: round trip (plans out -> result in, overlaps the stages)",
            [r.controller.round_trip_ms for r in results],
        )
    )
    for stage in range(len(results[0].stages)):
        rows.append((f"stage {stage}: step", [r.stages[stage].step_ms for r in results]))
        for name, label in STAGE_PHASES:
            values = [r.stages[stage].phases_ms[name] for r in results]
            rows.append((f"stage {stage}: {label}", values))
        rows.append(
            (
                f"stage {stage}: idle between steps (waiting for a plan)",
                [r.stages[stage].idle_ms for r in results],
            )
        )
    return rows


def vllm_line(vllm: list[VllmTpot]) -> str:
    if not vllm:
        return (
            "vLLM median TPOT: not measured (run `make bench-vs-vllm`, or pass --vllm-tpot-ms "
            "or --vllm-summary)"
        )
    by_source: dict[str, list[str]] = {}
    for v in vllm:
        by_source.setdefault(v.source, []).append(f"{ms(v.median_tpot_ms)} ms {v.what}")
    return "; ".join(
        f"vLLM median TPOT ({source}): {', '.join(items)}" for source, items in by_source.items()
    )


def markdown(title: str, results: list[ScenarioBreakdown], vllm: list[VllmTpot]) -> str:
    header = "| ms per micro-batch | " + " | ".join(r.label for r in results) + " |"
    lines = [title, "", header, "|---|" + "---:|" * len(results)]
    for label, values in table_rows(results):
        lines.append(f"| {label} | " + " | ".join(ms(v) for v in values) + " |")
    lines += ["", vllm_line(vllm)]
    return "\n".join(lines)


def as_json(results: list[ScenarioBreakdown], vllm: list[VllmTpot]) -> dict[str, object]:
    scenarios = []
    for r in results:
        entry = asdict(r)
        if math.isnan(r.client_tpot_ms):  # JSON has no NaN
            entry["client_tpot_ms"] = None
        entry["controller"]["other_ms"] = r.controller.other_ms
        for stage, out in zip(r.stages, entry["stages"], strict=True):
            out["unaccounted_ms"] = stage.unaccounted_ms
            out["idle_ms"] = stage.idle_ms
        scenarios.append(entry)
    return {
        "unit": "ms per micro-batch",
        "scenarios": scenarios,
        "vllm_tpot": [asdict(v) for v in vllm] or "not measured",
    }


def read_vllm_summary(path: Path) -> list[VllmTpot]:
    """vLLM's median TPOT per workload of a `make bench-vs-vllm` summary.json: at its lowest
    rate (light load) and with every request at once; [] without the file. Raises ValueError,
    naming the file, for one that is not such a summary."""
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
        rows = [r for r in data["rows"] if r["system"] == "vllm"]
        out = []
        for workload in sorted({r["workload"] for r in rows}):
            runs = sorted(
                (r for r in rows if r["workload"] == workload), key=lambda r: float(r["rate"])
            )
            out.append(
                VllmTpot(
                    str(path), f"{workload} at {runs[0]['rate']} req/s", runs[0]["median_tpot_ms"]
                )
            )
            if runs[-1]["rate"] == "inf":
                every = f"{workload} with all {data['num_prompts']} requests at once"
                out.append(VllmTpot(str(path), every, runs[-1]["median_tpot_ms"]))
        return out
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a bench-vs-vllm summary ({err!r})") from None
