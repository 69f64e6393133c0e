"""Where ours' pipeline bubble goes, run by run, from the controller's step log.

    PYTHONPATH=tools:. .venv/bin/python -m bench_vs_vllm.bubble_causes RESULTS [--system S]

RESULTS is a `make bench-vs-vllm` results folder; S is ours' pipeline there (default
sarathi-pp2). Each stage's idle time while some request was in the system (its bubble,
bubbles.py) is split by what the pipeline held at that moment:
- `none`: no micro-batch in flight (the controller between results and plans, or prompts
  still on their way in);
- `one`: one micro-batch in flight, on the other stage or crossing: largely a request alone,
  whose tokens follow one another while it decodes;
- `waiting, decodes` / `waiting, prompt`: two or more in flight and the other stage busy on a
  micro-batch of decodes alone / one carrying prompt tokens: the stages' imbalance for that
  kind of micro-batch (a stage with more layers is slower at prompt chunks; the LM head's
  stage at decodes), and this stage's result going round the controller;
- `hand-off`: two or more in flight and both stages idle: the micro-batches on the wire or in
  the controller.
Each as a share of the time the run had requests in the system, over the whole run, as
bubbles.py's bubble fraction counts it; the parts add up to the stage's idle share. vLLM's
stage hook times its stages' steps but not its micro-batches, so this is ours only. The split
is taken on a grid of GRID_S (a few bytes a cell: tens of MB for a ten-minute run).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench_vs_vllm.bubbles import (
    MicroBatchTimes,
    read_step_log,
    runs_of,
    step_log_main,
    tables_of_ours,
)
from bench_vs_vllm.servers import STEP_LOG

GRID_S = 1e-4
"""The clock's step for the split: a tenth of a millisecond, under a step's hundredth."""

CAUSES = ("none", "one", "waiting, decodes", "waiting, prompt", "hand-off")


def _cells(start_s: float, end_s: float, lo: float, n: int) -> slice:
    """The cells of a grid of n from lo whose left edges lie in [start_s, end_s): half-open,
    so that back-to-back intervals share no cell."""
    first = math.ceil((start_s - lo) / GRID_S)
    return slice(max(0, first), min(n, math.ceil((end_s - lo) / GRID_S)))


def idle_causes(
    batches: Sequence[MicroBatchTimes], spans: Sequence[tuple[float, float]]
) -> list[dict[str, float]]:
    """Each stage's idle time while requests were in the system, by CAUSES, as shares of that
    time (the run: its first request's start to its last one's finish)."""
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    n = math.ceil((hi - lo) / GRID_S)
    in_system = np.zeros(n, bool)
    for start, end in spans:
        in_system[_cells(start, end, lo, n)] = True
    num_stages = max((len(b.stage_steps) for b in batches), default=0)
    in_flight = np.zeros(n, np.int32)
    on_stage = np.zeros((num_stages, n), np.int8)  # 0 idle, 1 decodes alone, 2 with a prompt
    for batch in batches:
        if batch.returned_s < lo or batch.sent_s > hi:
            continue
        in_flight[_cells(batch.sent_s, batch.returned_s, lo, n)] += 1
        for stage, (end, busy) in enumerate(batch.stage_steps):
            on_stage[stage, _cells(end - busy, end, lo, n)] = 2 if batch.carries_prompt else 1
    total = max(int(in_system.sum()), 1)
    causes = []
    for stage in range(num_stages):
        idle = in_system & (on_stage[stage] == 0)
        several = idle & (in_flight >= 2)
        # with two stages "the other" is one stage; deeper, any other stage busy
        others = np.delete(on_stage, stage, axis=0).max(axis=0, initial=0)
        masks = {
            "none": idle & (in_flight == 0),
            "one": idle & (in_flight == 1),
            "waiting, decodes": several & (others == 1),
            "waiting, prompt": several & (others == 2),
            "hand-off": several & (others == 0),
        }
        causes.append({cause: float(mask.sum()) / total for cause, mask in masks.items()})
    return causes


def causes_table(results: Path, system: str) -> str:
    """A markdown table: every run of `system` in `results`, a row a stage."""
    batches = read_step_log(results / "stages" / system / STEP_LOG)
    lines = [
        "| run | stage | idle | " + " | ".join(CAUSES) + " |",
        "| --- | ---: | ---: |" + " ---: |" * len(CAUSES),
    ]
    for run, spans in runs_of(results, system):
        for stage, shares in enumerate(idle_causes(batches, spans)):
            cells = " | ".join(f"{100 * shares[c]:.1f}%" for c in CAUSES)
            lines.append(f"| {run} | {stage} | {100 * sum(shares.values()):.1f}% | {cells} |")
    return "\n".join(lines)


def all_causes_tables(results: Path) -> str:
    """causes_table for each system of ours in `results`, under its name; "" where there is none."""
    return tables_of_ours(results, causes_table)


def main(argv: Sequence[str] | None = None) -> int:
    return step_log_main(__doc__, causes_table, argv)


if __name__ == "__main__":
    raise SystemExit(main())
