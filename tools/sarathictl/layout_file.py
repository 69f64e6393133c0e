"""The layout `sarathictl tune-layout` measured on this machine, kept for `up --local`.

One JSON file maps a machine key to the layouts measured there and the one that won. The key
names everything the result depends on: the CPU (its model name and the flags our kernels and
dtype choice go by), the cores this process may use, the dtype `up` is asked for (`auto`, which
lets the measurement choose the dtype too, or a name) and the model's shape (a hash of its
config.json). A measurement is never applied to another CPU, core count, dtype or model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sarathictl.budget_fit import StepFit, fit_steps
from stage_worker.dtype_names import DTYPE_NAMES

KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The /proc/cpuinfo flags the kernels and the dtype are chosen by."""

THROUGHPUT_TIE = 0.05
"""Layouts whose burst throughput is within this share of the best one's are a tie, which the
lone request's TPOT breaks: one run's noise on a shared machine is about that size."""

FORMAT_VERSION = 2
"""2 since each layout names its dtype (session 24); a version 1 file is passed over."""


def default_layout_file() -> Path:
    """$SARATHI_LAYOUT_FILE, else layouts.json in the user's cache folder ($XDG_CACHE_HOME or
    ~/.cache): a measurement belongs to the machine, not to a checkout."""
    given = os.environ.get("SARATHI_LAYOUT_FILE")
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "sarathi-cluster" / "layouts.json"


@dataclass(frozen=True)
class MachineKey:
    cpu: str
    """The CPU's model name."""
    flags: tuple[str, ...]
    """Which of KERNEL_FLAGS it has."""
    cores: int
    """Cores this process may run on."""
    dtype: str
    """The dtype asked for: `auto` or a name (the dtype each layout ran is in its figures)."""
    model: str
    """The first 16 hex digits of config.json's SHA-256: the model's shape."""

    def as_text(self) -> str:
        return f"{self.cpu} [{' '.join(self.flags)}] x{self.cores} {self.dtype} model:{self.model}"


def machine_key(model_dir: str, dtype: str, cpuinfo: str = "/proc/cpuinfo") -> MachineKey:
    cpu, flags = "unknown CPU", set[str]()
    try:
        lines = Path(cpuinfo).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip() == "model name" and cpu == "unknown CPU":
            cpu = value.strip()
        elif name.strip() == "flags" and not flags:
            flags = set(value.split())
    config = Path(model_dir) / "config.json"
    try:
        model = hashlib.sha256(config.read_bytes()).hexdigest()[:16]
    except OSError as err:
        raise ValueError(f"--model {model_dir}: cannot read config.json ({err})") from err
    return MachineKey(
        cpu=cpu,
        flags=tuple(f for f in KERNEL_FLAGS if f in flags),
        cores=len(os.sched_getaffinity(0)),
        dtype=dtype,
        model=model,
    )


def layout_name(pp: int, dtype: str) -> str:
    """How a layout is named in tune-layout's and up's output."""
    return f"PP={pp} {dtype}"


@dataclass(frozen=True)
class LayoutFigures:
    """One layout as tune-layout ran it, and what it measured (medians over its rounds)."""

    pp: int
    dtype: str
    threads_per_worker: int
    budget_tokens: int
    burst_requests_per_s: float
    """Requests sent at once, over the seconds until the last one's last token."""
    lone_ttft_ms: float
    lone_tpot_ms: float
    """A request alone: its first token's time, and the mean gap between its tokens after it."""
    prompt_tokens: int = 0
    """The lone request's prompt; 0 in a file written before session 27, which has no fit."""
    idle_budget_tokens: int = 0
    """The budget the lone prompt went in (with nothing decoding); 0: `budget_tokens`."""

    @property
    def name(self) -> str:
        return layout_name(self.pp, self.dtype)

    def step_fit(self) -> StepFit | None:
        """The step's cost fitted to the lone request (budget_fit.py); None without the prompt's
        length (an older file) or where the figures admit no fit."""
        chunk = self.idle_budget_tokens or self.budget_tokens
        return fit_steps(self.lone_ttft_ms, self.lone_tpot_ms, self.prompt_tokens, chunk)

    def problem(self) -> str:
        """What makes these figures unusable (a hand-edited or damaged file), or ''."""
        counts = (self.pp, self.threads_per_worker, self.budget_tokens)
        if not all(type(n) is int and n >= 1 for n in counts):
            return "depths, threads and budgets must be whole numbers from 1"
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_NAMES:
            return f"unknown dtype {self.dtype!r}"
        if not all(
            type(n) is int and n >= 0 for n in (self.prompt_tokens, self.idle_budget_tokens)
        ):
            return "prompt tokens and idle budgets must be whole numbers from 0"
        measured = (self.burst_requests_per_s, self.lone_ttft_ms, self.lone_tpot_ms)
        if not all(type(x) in (int, float) and x > 0 for x in measured):
            return "figures must be positive numbers"
        return ""


@dataclass(frozen=True)
class MeasuredLayout:
    pp: int
    """The winner's depth (choose)."""
    dtype: str
    """The winner's dtype."""
    measured_on: str
    """ISO date."""
    workload: str
    """What was measured, in words (e.g. `4 rounds of a lone request and a burst of 8 requests
    of 256 + 64 tokens`)."""
    figures: tuple[LayoutFigures, ...]

    def winner(self) -> LayoutFigures:
        return next(f for f in self.figures if (f.pp, f.dtype) == (self.pp, self.dtype))

    def best_at(self, pp: int) -> LayoutFigures | None:
        """What runs when --pp is given: the winner at its own depth (choose's tie band could
        name another there once the other depths are left out), else the winner among that
        depth's layouts; None when that depth was not measured."""
        if pp == self.pp:
            return self.winner()
        at = tuple(f for f in self.figures if f.pp == pp)
        return choose(at) if at else None

    def one_stage(self, dtype: str) -> LayoutFigures | None:
        """The PP=1 layout of `dtype`, whose steps the budgets are fitted to; None if not run."""
        return next((f for f in self.figures if (f.pp, f.dtype) == (1, dtype)), None)

    def only(self, dtype: str) -> MeasuredLayout | None:
        """The measurement as if only `dtype`'s layouts had been run (for `up --dtype NAME`
        where --dtype auto was measured): the winner if it is of that dtype, else the best of
        them; None when none of them was run."""
        figures = tuple(f for f in self.figures if f.dtype == dtype)
        if not figures:
            return None
        won = self.winner() if self.dtype == dtype else choose(figures)
        return replace(self, pp=won.pp, dtype=won.dtype, figures=figures)

    def why(self) -> str:
        """Up's line: where the winner came from and what it measured against every other
        layout."""
        won = self.winner()
        others = "; ".join(
            f"{won.burst_requests_per_s / f.burst_requests_per_s:.2f}x {f.name}'s throughput, "
            f"{won.lone_tpot_ms / f.lone_tpot_ms:.2f}x its TPOT"
            for f in self.figures
            if f != won
        )
        return (
            f"measured on this machine by `sarathictl tune-layout` on {self.measured_on} "
            f"({others}; {self.workload})"
        )


def choose(figures: tuple[LayoutFigures, ...]) -> LayoutFigures:
    """The layout with the highest burst throughput; among those within THROUGHPUT_TIE of it,
    the one whose lone request decodes fastest."""
    if not figures:
        raise ValueError("choose: no layout measured")
    best = max(f.burst_requests_per_s for f in figures)
    tied = [f for f in figures if f.burst_requests_per_s >= best * (1 - THROUGHPUT_TIE)]
    return min(tied, key=lambda f: f.lone_tpot_ms)


class LayoutFileError(ValueError):
    pass


def _read_all(path: Path) -> dict[str, object]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as err:
        raise LayoutFileError(f"{path}: {err}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise LayoutFileError(f"{path}: not JSON ({err})") from err
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        raise LayoutFileError(
            f"{path}: not a version {FORMAT_VERSION} layout file (`sarathictl tune-layout` "
            "writes one)"
        )
    machines = data.get("machines")
    if not isinstance(machines, dict):
        raise LayoutFileError(f"{path}: no `machines` table")
    return machines


def read_measured(path: Path, key: MachineKey) -> MeasuredLayout | None:
    """The layout measured for `key`, None when there is none; LayoutFileError when the file
    cannot be read or the entry is malformed."""
    entry = _read_all(path).get(key.as_text())
    if entry is None:
        return None
    malformed = f"{path}: the entry for {key.as_text()} is malformed"
    if not isinstance(entry, dict):
        raise LayoutFileError(malformed)
    try:
        figures = tuple(LayoutFigures(**f) for f in entry["figures"])
        measured = MeasuredLayout(
            pp=int(entry["pp"]),
            dtype=str(entry["dtype"]),
            measured_on=str(entry["measured_on"]),
            workload=str(entry["workload"]),
            figures=figures,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise LayoutFileError(malformed) from err
    problem = next((p for p in (f.problem() for f in figures) if p), "")
    if problem:
        raise LayoutFileError(f"{malformed}: {problem}")
    if not any((f.pp, f.dtype) == (measured.pp, measured.dtype) for f in figures):
        raise LayoutFileError(f"{malformed}: the winner is not among its layouts")
    return measured


def write_measured(path: Path, key: MachineKey, measured: MeasuredLayout) -> None:
    """Adds or replaces `key`'s entry; other machines' entries stay. An unreadable file (or one
    of another version) is replaced whole. Written to a temporary file and renamed, so a reader
    never sees half of it."""
    try:
        machines = _read_all(path)
    except LayoutFileError:
        machines = {}
    machines[key.as_text()] = asdict(measured)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"version": FORMAT_VERSION, "machines": machines}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".layouts-", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump(document, out, indent=1)
        out.write("\n")
    os.replace(tmp, path)
