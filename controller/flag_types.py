"""The argparse `type=`s of the controller's flags: a bad value fails at parse time, naming the
flag, the value and the rule. Importable without the controller's server code (`sarathictl up`
builds some of the same flags)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Number:
    """An argparse `type=`: an int or finite float that `ok` accepts. A bad value fails at parse
    time naming the flag, the value and the rule: `argument --pp: must be at least 1, got 0`.
    (The bounds are the configuration's own, which checks them again when it is built.)"""

    kind: type[int] | type[float]
    allowed: str
    ok: Callable[[Any], bool]
    bad_values: tuple[str, ...]
    """Values refused: tests/unit/test_cli_flags.py feeds them to the flag."""

    def __call__(self, text: str) -> int | float:
        try:
            value: int | float | None = self.kind(text)
        except ValueError:
            value = None
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            noun = "an integer" if self.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {noun} {self.allowed}, got {text!r}")
        if not self.ok(value):
            raise argparse.ArgumentTypeError(f"must be {self.allowed}, got {text}")
        return value


def int_at_least(lo: int) -> Number:
    return Number(int, f"at least {lo}", lambda v: v >= lo, ("abc", str(lo - 1)))


def power_of_two() -> Number:
    return Number(int, "a power of two", lambda v: v >= 1 and not v & (v - 1), ("abc", "0", "24"))


def port(zero: str) -> Number:
    """A TCP port; `zero` says what 0 means for this flag."""
    return Number(
        int,
        f"a TCP port in [0, 65535] (0: {zero})",
        lambda v: 0 <= v <= 65535,
        ("x", "-1", "65536"),
    )


def float_above(lo: float) -> Number:
    return Number(float, f"above {lo:g}", lambda v: v > lo, ("abc", "nan", f"{lo:g}"))


def float_in(lo: float, hi: float, *, lo_open: bool = False) -> Number:
    """[lo, hi], or (lo, hi] with lo_open."""
    allowed = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    bad = ("abc", "nan", f"{lo if lo_open else lo - 1:g}", f"{hi + 1:g}")
    return Number(float, allowed, lambda v: (v > lo if lo_open else v >= lo) and v <= hi, bad)


@dataclass(frozen=True)
class LayerCounts:
    """An argparse `type=`: layer counts, comma-separated, each at least 1 (`17,13`)."""

    allowed: str = "comma-separated layer counts per stage, each at least 1"
    bad_values: tuple[str, ...] = ("abc", "17,0", "17,")

    def __call__(self, text: str) -> tuple[int, ...]:
        if not text:
            return ()  # the default: the workers' split
        parts = text.split(",")
        if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise argparse.ArgumentTypeError(f"must be {self.allowed}, got {text!r}")
        return tuple(int(p) for p in parts)
