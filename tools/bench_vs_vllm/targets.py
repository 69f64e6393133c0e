"""Issue 30's targets read off the driver's runs: each a ratio of ours over vLLM's in the same
run, with its verdict, so that a CPU's column comes out of the results rather than by hand.

    python -m bench_vs_vllm.targets RESULTS_DIR [RESULTS_DIR ...]

prints them for one pass or several (a column a pass, each from its `summary.json`); the
driver's report.md carries its own pass's.

Which systems stand for whom:
- ours: `sarathi` (up's own layout) where it ran, else `sarathi-pp1`, else `sarathi-pp2`;
- vLLM's best layout: of `vllm` and `vllm-pp2`, the one with the higher saturated throughput
  on that workload (its capacity: the higher of the two);
- pipeline against pipeline: `sarathi-pp2` against `vllm-pp2`.
A target whose systems did not run says so; it is never counted as met.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench_vs_vllm.results import Row, capacity, row_from_summary

OURS = ("sarathi", "sarathi-pp1", "sarathi-pp2")
VLLM = ("vllm", "vllm-pp2")
SATURATED_MIN = 1.2
CAPACITY_MIN = 1.5
PIPELINE_CAPACITY_MIN = 2.0
BUBBLE_MAX = 0.05
TPOT_ASKS_BELOW_MS = 100.0
"""The TPOT/TTFT target holds only at rates where vLLM's P99 TPOT is under this."""

TARGETS = (
    f"saturated throughput >= {SATURATED_MIN:g}x",
    f"median TPOT and TTFT <= vLLM's where its P99 TPOT < {TPOT_ASKS_BELOW_MS:g} ms",
    f"strict-SLO capacity >= {CAPACITY_MIN:g}x",
    f"pipelines (PP=2 against vLLM -pp 2): strict-SLO capacity >= {PIPELINE_CAPACITY_MIN:g}x",
    f"pipelines: steady-state bubble <= {100 * BUBBLE_MAX:g}% at that load",
)


@dataclass(frozen=True)
class Verdict:
    target: str
    workload: str
    value: str
    """What was measured, in words and numbers."""
    met: bool | None
    """None: not measured, or nothing asked."""

    def cell(self) -> str:
        verdict = {True: ": **met**", False: ": **missed**", None: ""}[self.met]
        return self.value + verdict


def _of(rows: list[Row], system: str) -> list[Row]:
    return [r for r in rows if r.system == system]


def _saturated(rows: list[Row]) -> Row | None:
    return next((r for r in rows if math.isinf(r.rate)), None)


def _ours(rows: list[Row]) -> str | None:
    return next((s for s in OURS if _of(rows, s)), None)


def _vllm_best(rows: list[Row]) -> str | None:
    """vLLM's layout with the higher saturated throughput (the one that ran, if only one did)."""
    ran = [(s, _saturated(_of(rows, s))) for s in VLLM if _of(rows, s)]
    if not ran:
        return None
    return max(ran, key=lambda sr: sr[1].request_throughput if sr[1] else -1.0)[0]


def _capacity_verdict(
    target: str, workload: str, ours: float, theirs: float, minimum: float
) -> Verdict:
    if theirs == 0:
        if ours == 0:
            return Verdict(target, workload, "neither serves any rate run", False)
        return Verdict(target, workload, f"{ours:g} req/s against none", True)
    ratio = ours / theirs
    return Verdict(
        target, workload, f"{ours:g} against {theirs:g} req/s ({ratio:.2f}x)", ratio >= minimum
    )


def _not_run(target: str, workload: str, what: str) -> Verdict:
    return Verdict(target, workload, f"not run ({what})", None)


def saturated(rows: list[Row], workload: str) -> Verdict:
    target = TARGETS[0]
    ours, vllm = _ours(rows), _vllm_best(rows)
    a = _saturated(_of(rows, ours)) if ours else None
    b = _saturated(_of(rows, vllm)) if vllm else None
    if a is None or b is None:
        return _not_run(target, workload, "ours and vLLM at rate inf")
    ratio = a.request_throughput / b.request_throughput
    value = (
        f"{a.request_throughput:.2f} ({ours}) against {b.request_throughput:.2f} req/s "
        f"({vllm}): {ratio:.2f}x"
    )
    return Verdict(target, workload, value, ratio >= SATURATED_MIN)


def latency(rows: list[Row], workload: str) -> Verdict:
    target = TARGETS[1]
    ours, vllm = _ours(rows), _vllm_best(rows)
    if ours is None or vllm is None:
        return _not_run(target, workload, "ours and vLLM")
    mine = {r.rate: r for r in _of(rows, ours)}
    asked = [r for r in _of(rows, vllm) if r.p99_tpot_ms < TPOT_ASKS_BELOW_MS and r.rate in mine]
    if not asked:
        return Verdict(
            target,
            workload,
            f"{vllm}'s P99 TPOT never under {TPOT_ASKS_BELOW_MS:g} ms: nothing asked",
            None,
        )
    tpot = sum(mine[r.rate].median_tpot_ms <= r.median_tpot_ms for r in asked)
    ttft = sum(mine[r.rate].median_ttft_ms <= r.median_ttft_ms for r in asked)
    rates = f"{len(asked)} rate" + ("s" if len(asked) != 1 else "")
    value = f"{rates} asked: TPOT as low at {tpot}, TTFT at {ttft}"
    return Verdict(target, workload, value, tpot == ttft == len(asked))


def strict_capacity(rows: list[Row], workload: str, strict_slo_ms: float) -> Verdict:
    target = TARGETS[2]
    ours = _ours(rows)
    theirs = [capacity(_of(rows, s), strict_slo_ms) for s in VLLM if _of(rows, s)]
    if ours is None or not theirs:
        return _not_run(target, workload, "ours and vLLM")
    return _capacity_verdict(
        target, workload, capacity(_of(rows, ours), strict_slo_ms), max(theirs), CAPACITY_MIN
    )


def pipeline_capacity(rows: list[Row], workload: str, strict_slo_ms: float) -> Verdict:
    target = TARGETS[3]
    ours, theirs = _of(rows, "sarathi-pp2"), _of(rows, "vllm-pp2")
    if not ours or not theirs:
        return _not_run(target, workload, "sarathi-pp2 and vllm-pp2")
    return _capacity_verdict(
        target,
        workload,
        capacity(ours, strict_slo_ms),
        capacity(theirs, strict_slo_ms),
        PIPELINE_CAPACITY_MIN,
    )


def pipeline_bubble(rows: list[Row], workload: str, strict_slo_ms: float) -> Verdict:
    target = TARGETS[4]
    ours, theirs = _of(rows, "sarathi-pp2"), _of(rows, "vllm-pp2")
    if not ours:
        return _not_run(target, workload, "sarathi-pp2")
    load = capacity(ours, strict_slo_ms)
    if load == 0:
        return Verdict(target, workload, "no rate run met the strict SLO", None)
    mine = next(r for r in ours if r.rate == load)
    if math.isnan(mine.steady_bubble_fraction):
        return Verdict(target, workload, f"at {load:g} req/s the stages were not timed", None)
    value = f"{100 * mine.steady_bubble_fraction:.1f}% at {load:g} req/s"
    vllm_there = next((r for r in theirs if r.rate == load), None)
    if vllm_there is not None and not math.isnan(vllm_there.steady_bubble_fraction):
        value += f" (vLLM -pp 2's {100 * vllm_there.steady_bubble_fraction:.1f}%)"
    return Verdict(target, workload, value, mine.steady_bubble_fraction <= BUBBLE_MAX)


def strict_slo_ms(slos_ms: dict[str, float]) -> float:
    """The strict SLO of a pass's named SLOs: the first (write_report names them strict first)."""
    return float(next(iter(slos_ms.values())))


def verdicts(rows: list[Row], strict_slo_ms: float) -> list[Verdict]:
    """Every target on every workload of one pass, in TARGETS order, workloads sorted."""
    out = []
    for workload in sorted({r.workload for r in rows}):
        mine = [r for r in rows if r.workload == workload]
        out += [
            saturated(mine, workload),
            latency(mine, workload),
            strict_capacity(mine, workload, strict_slo_ms),
            pipeline_capacity(mine, workload, strict_slo_ms),
            pipeline_bubble(mine, workload, strict_slo_ms),
        ]
    return out


def targets_table(passes: Sequence[list[Verdict]], names: Sequence[str]) -> str:
    """A row per (target, workload), a column per pass."""
    header = "| target | workload | " + " | ".join(names) + " |"
    lines = [header, "| --- | --- |" + " --- |" * len(names)]
    keys = [(v.target, v.workload) for v in passes[0]]
    for target in TARGETS:
        for key in (k for k in keys if k[0] == target):
            cells = []
            for verdicts_of_pass in passes:
                found = next((v for v in verdicts_of_pass if (v.target, v.workload) == key), None)
                cells.append(found.cell() if found else "not run")
            lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts_of_summary(summary: dict[str, object]) -> list[Verdict]:
    """One pass's verdicts from its summary.json: its rows and its first (strict) SLO."""
    slos = summary["slo_ms"]
    rows = summary["rows"]
    assert isinstance(slos, dict) and isinstance(rows, list), "not a bench_vs_vllm summary"
    return verdicts([row_from_summary(r) for r in rows], strict_slo_ms(slos))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    passes, names = [], []
    for folder in map(Path, argv):
        path = folder / "summary.json"
        if not path.is_file():
            print(f"{path}: no such file (a results folder of `python -m bench_vs_vllm`)")
            return 2
        passes.append(verdicts_of_summary(json.loads(path.read_text())))
        names.append(folder.name)
    print(targets_table(passes, names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
