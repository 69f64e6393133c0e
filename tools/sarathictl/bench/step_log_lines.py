"""Reading the controller's step log (`--step-log`, controller/step_log.py): its lines from an
offset on, and the controller's turnaround between a result and the next plan's start, which
the calibration (calibrate.py) and each live capacity probe (probe_steps.py) report."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

NEXT_PLAN_WITHIN_S = 0.005
"""A plan sent this soon after a result was sent because of it (the pipeline was full)."""


def read_step_log(path: Path, offset: int = 0) -> list[dict[str, Any]]:
    """The step log's whole lines from byte `offset` on (a line the controller is still
    writing, without its newline, is left out)."""
    with open(path) as f:
        f.seek(offset)
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def lines_sent_since(path: Path, offset: int, since_s: float) -> list[dict[str, Any]]:
    """The lines from byte `offset` on of micro-batches sent at perf_counter() second `since_s`
    or later: a run's own, without the late lines of work sent before it (a run stopped early
    leaves its last micro-batches to finish, and their lines come after it ended)."""
    return [
        line
        for line in read_step_log(path, offset)
        if line["opened_at_s"] + line["sent_s"] >= since_s
    ]


def turnaround_s(lines: Sequence[dict[str, Any]]) -> float:
    """Median time from a micro-batch's end on the last stage to the start on stage 0 of the
    plan its result let the controller send (sent within NEXT_PLAN_WITHIN_S of the result's
    return); 0 when the load never filled the pipeline. A stage's end is when the controller
    read its report, its start that less the stage's own time."""
    by_sent = sorted(lines, key=lambda line: line["sent_s"])
    sent = [line["sent_s"] for line in by_sent]
    gaps = []
    for line in lines:
        i = int(np.searchsorted(sent, line["returned_s"]))
        if i == len(sent) or sent[i] - line["returned_s"] > NEXT_PLAN_WITHIN_S:
            continue
        last_end = min(line["returned_s"], line["stages"][-1]["reported_s"])
        first = by_sent[i]["stages"][0]
        gaps.append(first["reported_s"] - first["work_s"] - last_end)
    return max(0.0, statistics.median(gaps)) if gaps else 0.0
