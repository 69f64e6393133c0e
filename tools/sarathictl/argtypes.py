"""Typed argparse `type=` callables shared by every sarathictl command.

A bad value fails at parse time, naming the flag, the value and what is allowed, in argparse's
own form (exit code 2):

    sarathictl generate: error: argument --max-tokens: must be at least 1, got -3

Each callable carries `allowed` (its rule in words) and `bad_values` (inputs it refuses), which
tests/unit/test_cli_flags.py feeds to every flag of every command. Enumerations with no aliases
use argparse's `choices=` instead.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

MAX_PORT = 65535
T = TypeVar("T")


@dataclass(frozen=True)
class Number:
    """An int or a finite float within optional bounds, open or closed."""

    kind: type[int] | type[float]
    lo: int | float | None = None
    hi: int | float | None = None
    lo_open: bool = False
    hi_open: bool = False
    rule: str = ""
    """The rule in words when the bounds alone say too little (e.g. a TCP port)."""

    def __post_init__(self) -> None:
        if self.lo is not None and self.hi is not None and self.lo > self.hi:
            raise ValueError(f"empty range [{self.lo}, {self.hi}]")

    @property
    def allowed(self) -> str:
        """The whole rule: `at least 1`, `in (0, 1]`, `a TCP port in [0, 65535] (0: off)`."""
        if self.rule:
            return self.rule
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"in {left}{_text(lo)}, {_text(hi)}{right}"
        return self._lower() or self._upper() or "finite"

    def _lower(self) -> str:
        if self.lo is None:
            return ""
        return f"{'above' if self.lo_open else 'at least'} {_text(self.lo)}"

    def _upper(self) -> str:
        if self.hi is None:
            return ""
        return f"{'below' if self.hi_open else 'at most'} {_text(self.hi)}"

    def broken_rule(self, value: float) -> str:
        """The bound `value` breaks (`at least 1` for -3), or "" when it is within them."""
        lo, hi = self.lo, self.hi
        if lo is not None and not (value > lo if self.lo_open else value >= lo):
            return self.rule or self._lower()
        if hi is not None and not (value < hi if self.hi_open else value <= hi):
            return self.rule or self._upper()
        return ""

    def __call__(self, text: str) -> int | float:
        try:
            value: int | float | None = self.kind(text)
        except ValueError:
            value = None
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            noun = "an integer" if self.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {noun} {self.allowed}, got {text!r}")
        if broken := self.broken_rule(value):
            raise argparse.ArgumentTypeError(f"must be {broken}, got {text}")
        return value

    @property
    def bad_values(self) -> tuple[str, ...]:
        bad = ["abc"] if self.kind is int else ["abc", "nan"]
        if self.lo is not None:
            bad.append(str(self.lo if self.lo_open else self.lo - 1))
        if self.hi is not None:
            bad.append(str(self.hi if self.hi_open else self.hi + 1))
        return tuple(bad)


def _text(bound: float) -> str:
    """1 for 1, 0.5 for 0.5, 0 for 0.0: a bound as a user would write it."""
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def int_at_least(lo: int) -> Number:
    return Number(int, lo)


def int_in_range(lo: int, hi: int) -> Number:
    """lo <= value <= hi."""
    return Number(int, lo, hi)


def float_at_least(lo: float) -> Number:
    return Number(float, lo)


def float_above(lo: float) -> Number:
    """value > lo (rates, timeouts, scales)."""
    return Number(float, lo, lo_open=True)


def float_in(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Number:
    """Within [lo, hi], each end open when asked: float_in(0, 1, lo_open=True) is (0, 1]."""
    return Number(float, lo, hi, lo_open, hi_open)


def port(zero: str = "any free port") -> Number:
    """A TCP port in [0, 65535]; `zero` says what 0 means for this flag (off, any free port)."""
    return Number(int, 0, MAX_PORT, rule=f"a TCP port in [0, {MAX_PORT}] (0: {zero})")


@dataclass(frozen=True, eq=False)  # hashed by identity: argparse looks types up in a dict
class Name:
    """One of a fixed set of names, case-insensitive, aliases allowed; returns the canonical name
    (for sets with aliases, where `choices=` would refuse an alias)."""

    what: str
    """What a name names, for the message: `GPU` gives `unknown GPU 'x'; known: ...`."""
    names: tuple[str, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def allowed(self) -> str:
        return f"known: {', '.join(self.names)}"

    def __call__(self, text: str) -> str:
        key = self.aliases.get(text.lower(), text.lower())
        if key not in self.names:
            raise argparse.ArgumentTypeError(f"unknown {self.what} {text!r}; {self.allowed}")
        return key

    @property
    def bad_values(self) -> tuple[str, ...]:
        return ("no-such-name",)


def one_of(what: str, names: Iterable[str], aliases: Mapping[str, str] | None = None) -> Name:
    return Name(what, tuple(sorted(names)), dict(aliases or {}))


@dataclass(frozen=True)
class CommaList(Generic[T]):
    """Comma-separated values, each checked by `item` (whose message then names the item)."""

    item: Callable[[str], T]
    allow_empty: bool = False

    @property
    def allowed(self) -> str:
        rule = getattr(self.item, "allowed", "")
        some = "a comma-separated list" if self.allow_empty else "a non-empty comma-separated list"
        return f"{some}, each {rule}" if rule else some

    def __call__(self, text: str) -> tuple[T, ...]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts and not self.allow_empty:
            raise argparse.ArgumentTypeError(f"must be {self.allowed}, got {text!r}")
        return tuple(self.item(p) for p in parts)

    @property
    def bad_values(self) -> tuple[str, ...]:
        inner: tuple[str, ...] = getattr(self.item, "bad_values", ())
        return inner if self.allow_empty else (",", *inner)


def comma_list(item: Callable[[str], T], *, allow_empty: bool = False) -> CommaList[T]:
    return CommaList(item, allow_empty)


@dataclass(frozen=True)
class NumberOrName:
    """A number within bounds, or one of a few names (`--tbt-slo 0.5` or `--tbt-slo strict`)."""

    number: Number
    names: tuple[str, ...]

    @property
    def allowed(self) -> str:
        return f"a number {self.number.allowed} or one of {', '.join(self.names)}"

    def __call__(self, text: str) -> float | int | str:
        if text in self.names:
            return text
        try:
            return self.number(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be {self.allowed}, got {text!r}") from None

    @property
    def bad_values(self) -> tuple[str, ...]:
        return self.number.bad_values


DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")
"""A torch device: cpu, cuda (every GPU here) or cuda:N."""


@dataclass(frozen=True)
class Device:
    """A torch device the workers run on: cpu, cuda or cuda:N."""

    allowed: str = "cpu, cuda or cuda:N"
    bad_values: tuple[str, ...] = ("tpu", "cuda:x")

    def __call__(self, text: str) -> str:
        if not DEVICE_PATTERN.fullmatch(text):
            raise argparse.ArgumentTypeError(f"must be {self.allowed}, got {text!r}")
        return text


def device() -> Device:
    return Device()


@dataclass(frozen=True)
class Workload:
    """A workload's name, or the path of a CSV trace that exists."""

    names: tuple[str, ...]

    @property
    def allowed(self) -> str:
        return f"one of {', '.join(self.names)}, or the path of a CSV trace"

    def __call__(self, text: str) -> str:
        if text in self.names or os.path.isfile(text):
            return text
        raise argparse.ArgumentTypeError(f"must be {self.allowed}, got {text!r}")

    @property
    def bad_values(self) -> tuple[str, ...]:
        return ("no-such-workload",)


def workload(names: Iterable[str]) -> Workload:
    return Workload(tuple(names))
