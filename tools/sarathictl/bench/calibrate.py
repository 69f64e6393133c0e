"""Calibrating the simulator on a live pipeline from its step log (the controller's
`--step-log`, controller/step_log.py): every micro-batch the calibration load runs is a row of
(prompt tokens, decodes, prefill pairs, decode keys) against the time each stage spent on it,
fitted as controller/simulator/linear_profile.py's coefficients, and the controller's
turnaround between a result and the next plan's start is measured beside it.

The load: lone prompts of 16 to 512 tokens (one micro-batch each when the cluster's budget
holds them), then groups of requests decoding together (1, 8 and 32 at 64-token prompts, 16 at
384), whose prompts prefill while the first decode and so give mixed micro-batches too.

An earlier version fitted server-side TTFTs and token gaps instead. A gap with 16 requests
decoding also held the prompt chunks of those still prefilling, so decodes were costed from
steps that were mostly prompt work, and prompts from single TTFTs that held every stage's hop:
the simulator came out 16-43% off in P99 TBT (BENCHMARKS.md). Reading each micro-batch's own
composition and stage time leaves nothing to infer.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from controller.executor.simulated import SimRequest
from controller.simulator.linear_profile import ProfileRow, StageCoefficients, fit_rows
from sarathictl.bench.live_load import replay
from sarathictl.bench.step_log_lines import read_step_log, turnaround_s
from sarathictl.client import Client
from sarathictl.commands.tune_budget import measure
from sarathictl.slo_rule import SLO_BATCH

PROMPT_TOKENS = (16, 32, 64, 128, 256, 512)
SLO_POINT = (SLO_BATCH, 64)
"""The SLO's decode step: a batch of 32 at 64-token prompts (slo_rule.py)."""
DECODE_POINTS = ((1, 64), (8, 64), SLO_POINT, (16, 384))
"""(sequences decoding together, their prompt tokens)."""
DECODE_OUTPUT_TOKENS = 24
SKIPPED_GAPS = 4
"""Gaps at the start of each request while the others' prompts still prefill."""


@dataclass(frozen=True)
class Calibration:
    rows: list[ProfileRow]
    """One per micro-batch of the calibration load: its stages' mean time."""
    coefficients: StageCoefficients
    decode32_gap_s: float
    """Median gap with 32 requests decoding together: the strict SLO's unit."""
    fit_error: dict[str, float]
    """The fitted profile against the rows: median and 90th percentile of |relative error|."""


def decode_gap_s(addr: str, batch: int, prompt_tokens: int) -> float:
    requests = [SimRequest(0.0, prompt_tokens, DECODE_OUTPUT_TOKENS) for _ in range(batch)]
    run = asyncio.run(replay(addr, requests))
    return statistics.median(g for r in run.records for g in r.gaps_s[SKIPPED_GAPS:])


def profile_rows(lines: Sequence[dict[str, Any]]) -> list[ProfileRow]:
    """One row per micro-batch: its features and its stages' mean time (every simulated stage
    costs the same)."""
    return [
        (
            line["prompt_tokens"],
            line["decodes"],
            line["prefill_pairs"],
            line["decode_keys"],
            statistics.fmean(s["work_s"] for s in line["stages"]),
        )
        for line in lines
    ]


def fit_error(rows: Sequence[ProfileRow], c: StageCoefficients) -> dict[str, float]:
    errors = [abs(c.stage_time_s(*row[:4]) / row[4] - 1) for row in rows]
    return {"median": statistics.median(errors), "p90": float(np.percentile(errors, 90))}


def calibrate(addr: str, step_log: Path, repeats: int, say: Callable[[str], None]) -> Calibration:
    rng = np.random.default_rng(0)
    with Client(addr) as client:
        measure(client, PROMPT_TOKENS[0], 1, rng)  # warm-up: first steps pay one-time costs
        offset = step_log.stat().st_size
        for n in PROMPT_TOKENS:
            ttft_s = measure(client, n, repeats, rng)
            say(f"calibration: lone {n}-token prompt, TTFT {ttft_s * 1e3:.1f} ms")
    decode32 = math.nan
    for batch, prompt in DECODE_POINTS:
        gap_s = statistics.median(decode_gap_s(addr, batch, prompt) for _ in range(repeats))
        say(f"calibration: {batch} decodes at {prompt}-token prompts, gap {gap_s * 1e3:.1f} ms")
        if (batch, prompt) == SLO_POINT:
            decode32 = gap_s
    lines = read_step_log(step_log, offset)
    rows = profile_rows(lines)
    c = replace(fit_rows(rows), turnaround_s=turnaround_s(lines))
    error = fit_error(rows, c)
    curve = ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in zip(c.token_knots, c.knot_s, strict=True))
    say(
        f"calibration: {len(rows)} micro-batches; a stage costs, in ms per n tokens, {curve}; "
        f"+ {c.per_decode_s * 1e3:.3f} ms/decode + {c.per_prefill_pair_s * 1e9:.1f} ns/prompt "
        f"pair + {c.per_decode_key_s * 1e9:.1f} ns/decode key; turnaround "
        f"{c.turnaround_s * 1e3:.2f} ms; fit error median {error['median']:.1%}, "
        f"p90 {error['p90']:.1%}"
    )
    return Calibration(rows, c, decode32, error)
