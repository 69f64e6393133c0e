"""The layout `sarathictl tune-layout` measured on this machine, kept for `up --local`.

One JSON file maps a machine key to the layouts measured there and the one that won. The key
names everything the result depends on: the CPU (its model name and the flags our kernels and
dtype choice go by), the cores this process may use, the dtype and the model's shape (a hash of
its config.json). A measurement is never applied to another CPU, core count, dtype or model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The /proc/cpuinfo flags the kernels and the dtype are chosen by."""

THROUGHPUT_TIE = 0.05
"""Layouts whose burst throughput is within this share of the best one's are a tie, which the
lone request's TPOT breaks: one run's noise on a shared machine is about that size."""

FORMAT_VERSION = 1


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


@dataclass(frozen=True)
class LayoutFigures:
    """One layout as tune-layout ran it, and what it measured."""

    pp: int
    threads_per_worker: int
    budget_tokens: int
    burst_requests_per_s: float
    """Requests sent at once, over the seconds until the last one's last token (median of the
    repeats)."""
    lone_ttft_ms: float
    lone_tpot_ms: float
    """A request alone: its first token's time, and the mean gap between its tokens after it."""


@dataclass(frozen=True)
class MeasuredLayout:
    pp: int
    """The depth that won (choose_pp)."""
    measured_on: str
    """ISO date."""
    workload: str
    """What the burst was, in words (e.g. `8 requests of 256 + 64 tokens`)."""
    figures: tuple[LayoutFigures, ...]

    def winner(self) -> LayoutFigures:
        return next(f for f in self.figures if f.pp == self.pp)

    def why(self) -> str:
        """Up's line: where the choice came from and what it measured."""
        won = self.winner()
        others = "; ".join(
            f"{won.burst_requests_per_s / f.burst_requests_per_s:.2f}x PP={f.pp}'s throughput, "
            f"{won.lone_tpot_ms / f.lone_tpot_ms:.2f}x its TPOT"
            for f in self.figures
            if f.pp != self.pp
        )
        return (
            f"measured on this machine by `sarathictl tune-layout` on {self.measured_on} "
            f"({others}; {self.workload})"
        )


def choose_pp(figures: tuple[LayoutFigures, ...]) -> int:
    """The depth with the highest burst throughput; among those within THROUGHPUT_TIE of it, the
    one whose lone request decodes fastest."""
    if not figures:
        raise ValueError("choose_pp: no layout measured")
    best = max(f.burst_requests_per_s for f in figures)
    tied = [f for f in figures if f.burst_requests_per_s >= best * (1 - THROUGHPUT_TIE)]
    return min(tied, key=lambda f: f.lone_tpot_ms).pp


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
        raise LayoutFileError(f"{path}: not a version {FORMAT_VERSION} layout file")
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
            measured_on=str(entry["measured_on"]),
            workload=str(entry["workload"]),
            figures=figures,
        )
        measured.winner()
        measured.why()  # ratios of positive numbers
    except (KeyError, TypeError, ValueError, StopIteration, ZeroDivisionError) as err:
        raise LayoutFileError(malformed) from err
    figures_ok = all(
        isinstance(x, (int, float)) and x > 0
        for f in figures
        for x in (f.burst_requests_per_s, f.lone_ttft_ms, f.lone_tpot_ms)
    )
    if not figures_ok:
        raise LayoutFileError(f"{malformed}: figures must be positive numbers")
    return measured


def write_measured(path: Path, key: MachineKey, measured: MeasuredLayout) -> None:
    """Adds or replaces `key`'s entry; other machines' entries stay. An unreadable file is
    replaced. Written to a temporary file and renamed, so a reader never sees half of it."""
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
