"""`sarathictl bench ...`: benchmarks. Each benchmark module adds one sub-command here."""

from __future__ import annotations

import argparse

from sarathictl.bench import (
    capacity_cmd,
    controller_step,
    paper,
    prefix_routing,
    run_cmd,
    scheduler_speed,
    simulate_cmd,
    stage_step_cmd,
    step_breakdown,
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("bench", help="benchmarks (scheduler speed, simulation, capacity)")
    bench_sub = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    scheduler_speed.register(bench_sub)
    simulate_cmd.register(bench_sub)
    capacity_cmd.register(bench_sub)
    paper.register(bench_sub)
    stage_step_cmd.register(bench_sub)
    run_cmd.register(bench_sub)
    controller_step.register(bench_sub)
    step_breakdown.register(bench_sub)
    prefix_routing.register(bench_sub)
