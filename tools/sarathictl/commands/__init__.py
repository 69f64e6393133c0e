"""The sarathictl commands. Each module exposes `register(subparsers)`, which adds its parser
and sets `run=callable(args) -> exit code` as the parser's default."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from sarathictl.commands import (
    bench,
    demo,
    generate,
    model,
    plan,
    status,
    tune_budget,
    tune_layout,
    up,
)

Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

COMMANDS: list[Register] = [
    up.register,
    generate.register,
    status.register,
    tune_budget.register,
    tune_layout.register,
    demo.register,
    bench.register,
    plan.register,
    model.register,
]
