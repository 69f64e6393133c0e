"""The controller's flags on what goes into a micro-batch and when (the idle and time budgets,
SLO mode, prompts spread over the pipeline, decodes ahead of their tokens); `sarathictl up`
takes them too, passed on."""

from __future__ import annotations

import argparse

from controller.flag_types import float_in, int_at_least
from controller.scheduler.config import SchedulerConfig

SPREAD_PROMPTS_HELP = (
    "PP > 1 with chunks pipelined: prompt tokens too few to fill every micro-batch in flight "
    "are divided among them, rather than filling one and sending the next with decodes alone"
)
"""What SchedulerConfig.spread_prompts does, for the controller's flag and the simulator's."""


def add_budget_flags(p: argparse.ArgumentParser) -> None:
    """The time budget, SLO mode and the spread of prompts (`sarathictl up` takes the same
    flags and passes them on)."""
    p.add_argument(
        "--step-cost",
        default="",
        metavar="FIXED_S,PER_TOKEN_S,PER_ATTENDED_S",
        help="the stage's cost profile (sarathictl bench stage prints it): with --time-budget "
        "or --tbt-slo, micro-batches are also budgeted in predicted stage time",
    )
    p.add_argument(
        "--idle-budget",
        type=int_at_least(0),
        default=0,
        help="PP=1, chunked policies: token budget per micro-batch while no sequence decodes "
        "(a multiple of --tile, at least --budget): a prompt alone goes in fewer, larger chunks, "
        "since no one waits between tokens (0: --budget always)",
    )
    p.add_argument(
        "--time-budget",
        type=float_in(0.0, 3600.0),
        default=0.0,
        help="seconds of predicted stage time per micro-batch (needs --step-cost; 0: tokens only)",
    )
    p.add_argument(
        "--tbt-slo",
        type=float_in(0.0, 3600.0),
        default=0.0,
        help="SLO mode: choose --budget, --max-num-seqs and the time budget so that the "
        "predicted P99 time between tokens stays under this many seconds (needs --step-cost; "
        "0: off)",
    )
    p.add_argument(
        "--spread-prompts",
        action=argparse.BooleanOptionalAction,
        default=SchedulerConfig.spread_prompts,
        help=f"{SPREAD_PROMPTS_HELP} (default on; measured live with shared prefixes: median "
        "TTFT about 0.85x and P99 TBT 0.9x at PP=2, BENCHMARKS.md, issue 30 sessions 33-34)",
    )
    p.add_argument(
        "--decode-ahead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="PP=1: schedule each decode's next step while its token is still being computed, "
        "so the stage finds its next plan waiting instead of idling while the controller "
        "applies the result (the worker feeds in the token it sampled; default on; measured "
        "on a 2-core CPU: BENCHMARKS.md, issue 30 sessions 38 and 39)",
    )
