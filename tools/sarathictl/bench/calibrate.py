"""Calibrating the simulator on a live pipeline: lone prompts (tune-budget's profile) and decode
batches timed on the running cluster, one stage's share of each fitted as
controller/simulator/linear_profile.py's three numbers.

A lone prompt of n tokens is one micro-batch crossing every stage: its server-side TTFT over PP
is a stage's time (the controller's share and the hand-offs included, as live). d requests
decoding together with PP micro-batches in flight advance once per round of PP stage times, so
the median gap over PP is a stage's time for about d / PP decodes."""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from controller.executor.simulated import SimRequest
from controller.scheduler.step_cost import attended
from controller.simulator.linear_profile import ProfileRow, StageCoefficients, fit_rows
from sarathictl.bench.live_load import replay
from sarathictl.client import Client
from sarathictl.commands.tune_budget import measure

PROMPT_TOKENS = (16, 32, 64, 128, 256)
DECODE_POINTS = ((1, 64), (8, 64), (32, 64), (16, 384))
"""(sequences decoding together, their prompt tokens); 32 at 64 is also the SLO's decode step."""
DECODE_OUTPUT_TOKENS = 24
SKIPPED_GAPS = 4
"""Gaps at the start of each request while the others' prompts still prefill."""


@dataclass(frozen=True)
class Calibration:
    rows: list[ProfileRow]
    coefficients: StageCoefficients
    decode32_gap_s: float
    """Median gap with 32 requests decoding together: the strict SLO's unit."""


def decode_gap_s(addr: str, batch: int, prompt_tokens: int) -> float:
    requests = [SimRequest(0.0, prompt_tokens, DECODE_OUTPUT_TOKENS) for _ in range(batch)]
    run = asyncio.run(replay(addr, requests))
    return statistics.median(g for r in run.records for g in r.gaps_s[SKIPPED_GAPS:])


def calibrate(addr: str, pp: int, repeats: int, say: Callable[[str], None]) -> Calibration:
    rng = np.random.default_rng(0)
    rows: list[ProfileRow] = []
    with Client(addr) as client:
        measure(client, PROMPT_TOKENS[0], 1, rng)  # warm-up: first steps pay one-time costs
        for n in PROMPT_TOKENS:
            pipeline_s = measure(client, n, repeats, rng)
            rows.append((n, 0, attended(0, n), 0, pipeline_s / pp))
            say(f"calibration: lone {n}-token prompt {pipeline_s * 1e3:.1f} ms")
    decode32 = math.nan
    for batch, prompt in DECODE_POINTS:
        gap_s = statistics.median(decode_gap_s(addr, batch, prompt) for _ in range(repeats))
        per_micro_batch = -(-batch // pp)
        context = prompt + DECODE_OUTPUT_TOKENS // 2
        rows.append((0, per_micro_batch, 0, per_micro_batch * (context + 1), gap_s / pp))
        say(f"calibration: {batch} decodes at {prompt}-token prompts, gap {gap_s * 1e3:.1f} ms")
        if (batch, prompt) == (32, 64):
            decode32 = gap_s
    first_token = [row[0] > 0 for row in rows]  # the lone prompts' rows are TTFTs
    c, first_token_s = fit_rows(rows, first_token)
    say(
        f"calibration: a stage costs {c.fixed_s * 1e3:.2f} ms + {c.per_prompt_token_s * 1e3:.3f} "
        f"ms/prompt token + {c.per_decode_s * 1e3:.3f} ms/decode"
        f" + {c.per_prefill_pair_s * 1e9:.1f} ns/prompt pair + {c.per_decode_key_s * 1e9:.1f} "
        f"ns/decode key; a first token {first_token_s * 1e3:.1f} ms more"
    )
    return Calibration(rows, c, decode32)
