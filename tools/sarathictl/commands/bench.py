"""`sarathictl bench ...`: benchmarks. Each benchmark module adds one sub-command here."""

from __future__ import annotations

import argparse

from sarathictl.bench import scheduler_speed


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("bench", help="benchmarks (scheduler speed, simulation, capacity)")
    bench_sub = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    scheduler_speed.register(bench_sub)
