"""Workloads for simulated and real benchmarks: request lengths from a trace or a distribution,
arrival times from a Poisson or gamma process or replayed from a trace, all from one seed.

Arrivals are drawn at rate 1 and divided by the QPS, so runs of one workload at different rates
share their random numbers (common random numbers): a capacity search then compares loads, not
noise. A replayed trace is rescaled the same way (its recorded rate becomes 1), so a search
stretches or squeezes its timeline and keeps its bursts; `recorded_qps` gives its own rate. A
rate curve (arrivals.py) then shapes the load over time (diurnal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from controller.executor.simulated import SimRequest
from sarathictl.argtypes import Workload, workload
from sarathictl.bench.arrivals import ARRIVALS, RateCurve, unit_gaps, unit_rate_times
from sarathictl.bench.trace_files import has_arrivals, read_trace_rows

# Shipped inside the package (package data), with their sources and licenses (traces/README.md).
TRACES_DIR = Path(__file__).resolve().parent / "traces"
TRACE_FILES = {"arxiv": "arxiv_summarization.csv", "splitwise": "splitwise_conv.csv"}
TRACE_ALIASES = {"arxiv_summarization": "arxiv", "splitwise_conv": "splitwise", "conv": "splitwise"}

# The paper's Table 2 (median, P90) of prompt and output tokens, and its length filter.
PAPER_DATASETS: dict[str, tuple[tuple[float, float], tuple[float, float], int]] = {
    "sharegpt-paper": ((1730, 5696), (415, 834), 8192),
    "arxiv-paper": ((7059, 12985), (208, 371), 16384),
}
SYNTHETIC = ("lognormal", "zipf", "uniform", "fixed")
_Z90 = 1.2815515655446004  # standard normal quantile at 0.9


@dataclass(frozen=True)
class WorkloadSpec:
    source: str = "arxiv"
    """A trace (arxiv, splitwise, or a CSV path), a paper dataset (sharegpt-paper, arxiv-paper)
    or a distribution (lognormal, zipf, uniform, fixed)."""
    num_requests: int = 1024
    seed: int = 0
    max_total_tokens: int = 0
    """Drop requests longer than this (prompt + output); 0: the source's own limit."""
    arrival: str = "poisson"
    """poisson, gamma (bursty when burstiness > 1), or replay (the trace's own arrival times,
    in file order; the first num_requests of them)."""
    burstiness: float = 1.0
    """Gamma arrivals: squared coefficient of variation of the gaps (1 is Poisson)."""
    rate_curve: tuple[float, ...] = ()
    """Relative arrival rates over equal slices of rate_period_s, repeating (empty: flat)."""
    rate_period_s: float = 3600.0
    """Period of rate_curve in seconds of arrival time (a day compressed to an hour by default,
    so that one benchmark run sees the whole cycle)."""
    prompt_tokens: int = 1024
    """Synthetic sources: the median (lognormal), maximum (zipf, uniform) or value (fixed)."""
    output_tokens: int = 128
    system_prompt_tokens: int = 0
    """Tokens of a system prompt put in front of every prompt (a chat product's), shared by
    the requests that draw the same one (the prefix cache computes it once); 0: none."""
    num_system_prompts: int = 1
    """Distinct system prompts, drawn round robin by the requests."""

    def __post_init__(self) -> None:
        if self.system_prompt_tokens < 0:
            raise ValueError(f"system_prompt_tokens must be >= 0, got {self.system_prompt_tokens}")
        if self.num_system_prompts < 1:
            raise ValueError(f"num_system_prompts must be >= 1, got {self.num_system_prompts}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_total_tokens < 0:
            raise ValueError("max_total_tokens must be >= 0")
        if self.rate_curve:
            RateCurve(self.rate_curve, self.rate_period_s)  # validates, naming the field

    def arrivals_at(self, unit_times_s: list[float], qps: float) -> list[float]:
        """Arrival times at a mean rate of qps from the unit-rate ones, the rate curve applied."""
        if not qps > 0:
            raise ValueError(f"qps must be > 0, got {qps}")
        times = np.asarray(unit_times_s, dtype=np.float64) / qps
        if self.rate_curve:
            times = RateCurve(self.rate_curve, self.rate_period_s).warp(times)
        return times.tolist()


def read_trace(path: Path) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) rows; a missing column or a bad value names the line."""
    return read_trace_rows(path).lengths


def default_arrival(source: str) -> str:
    """replay for a trace file that records arrival times, poisson otherwise."""
    name = TRACE_ALIASES.get(source, source)
    if name in PAPER_DATASETS or name in SYNTHETIC:
        return "poisson"
    return "replay" if has_arrivals(trace_path(source)) else "poisson"


def recorded_qps(spec: WorkloadSpec) -> float:
    """A replayed trace's own mean rate over its first num_requests requests."""
    rows = _replay_rows(spec)
    return unit_rate_times([t for t, _, _ in rows])[1]


def known_workloads() -> list[str]:
    """Every workload name `WorkloadSpec.source` takes besides a CSV path."""
    return [*TRACE_FILES, *PAPER_DATASETS, *SYNTHETIC]


def workload_flag() -> Workload:
    """The `type=` of a --trace flag: a known name (or alias), or a CSV file that exists."""
    return workload([*known_workloads(), *TRACE_ALIASES])


def trace_path(source: str) -> Path:
    """The CSV behind a trace name or a path; a name that is neither lists the known ones."""
    name = TRACE_ALIASES.get(source, source)
    if name in TRACE_FILES:
        path = TRACES_DIR / TRACE_FILES[name]
        if not path.is_file():  # a broken install, not a user error: say where it looked
            raise ValueError(f"trace {source!r}: its file {path} is missing from the package")
        return path
    path = Path(source)
    if not path.is_file():
        known = ", ".join(known_workloads())
        raise ValueError(
            f"unknown workload {source!r}: not a known name and no such CSV file; "
            f"known names: {known}"
        )
    return path


def _lognormal(rng: np.random.Generator, median: float, p90: float, size: int) -> np.ndarray:
    sigma = math.log(p90 / median) / _Z90
    return np.maximum(1, np.rint(rng.lognormal(math.log(median), sigma, size))).astype(np.int64)


def _lengths(spec: WorkloadSpec, rng: np.random.Generator) -> tuple[list[tuple[int, int]], int]:
    """Request lengths (before the length filter), and the source's own length limit."""
    n = spec.num_requests
    source = TRACE_ALIASES.get(spec.source, spec.source)
    if source in PAPER_DATASETS:
        (p50, p90), (o50, o90), limit = PAPER_DATASETS[source]
        # Oversample so the length filter still leaves n requests.
        size = 2 * n + 64
        prompts, outputs = _lognormal(rng, p50, p90, size), _lognormal(rng, o50, o90, size)
        return list(zip(prompts.tolist(), outputs.tolist(), strict=True)), limit
    if source in SYNTHETIC:
        p, o = spec.prompt_tokens, spec.output_tokens
        if source == "fixed":
            return [(p, o)] * n, 0
        if source == "uniform":
            prompts, outputs = rng.integers(1, p + 1, n), rng.integers(1, o + 1, n)
        elif source == "zipf":
            prompts = np.minimum(rng.zipf(1.5, n) * 16, p)
            outputs = np.minimum(rng.zipf(1.5, n) * 4, o)
        else:
            prompts = _lognormal(rng, p, 4 * p, 2 * n + 64)
            outputs = _lognormal(rng, o, 2 * o, 2 * n + 64)
        return list(zip(prompts.tolist(), outputs.tolist(), strict=True)), 0
    rows = read_trace(trace_path(spec.source))
    picks = rng.integers(0, len(rows), 2 * n + 64)
    return [rows[i] for i in picks.tolist()], 0


def make_requests(spec: WorkloadSpec, qps: float) -> list[SimRequest]:
    """num_requests requests arriving at qps requests/s on average, sorted by arrival."""
    rows = unit_rate_requests(spec)
    return sim_requests(spec, spec.arrivals_at([t for t, _, _ in rows], qps), rows)


def sim_requests(
    spec: WorkloadSpec, times_s: list[float], rows: list[tuple[float, int, int]]
) -> list[SimRequest]:
    """unit_rate_requests' rows at these arrival times, each naming its system prompt."""
    shared = spec.system_prompt_tokens
    return [
        SimRequest(t, p, o, i % spec.num_system_prompts if shared else -1, shared)
        for i, (t, (_, p, o)) in enumerate(zip(times_s, rows, strict=True))
    ]


def _replay_rows(spec: WorkloadSpec) -> list[tuple[float, int, int]]:
    """The trace's first num_requests requests (all if it has fewer) within the length limit,
    at their recorded times (seconds from the first)."""
    name = TRACE_ALIASES.get(spec.source, spec.source)
    if name in PAPER_DATASETS or name in SYNTHETIC:
        raise ValueError(f"arrival replay needs a trace with arrival times, not {spec.source!r}")
    path = trace_path(spec.source)
    trace = read_trace_rows(path)
    if trace.arrivals_s is None:
        raise ValueError(
            f"arrival replay: {path} records no arrival times (a column arrived_at, arrival_s "
            "or timestamp); use poisson or gamma arrivals with it"
        )
    rows = [(t, p, o) for t, (p, o) in zip(trace.arrivals_s, trace.lengths, strict=True)]
    if spec.max_total_tokens:
        rows = [r for r in rows if r[1] + r[2] <= spec.max_total_tokens]
    return rows[: spec.num_requests]


def unit_rate_requests(spec: WorkloadSpec) -> list[tuple[float, int, int]]:
    """(arrival at rate 1 request/s, prompt tokens, output tokens): scale arrivals by 1/qps.
    A system prompt counts in the prompt tokens."""
    rows = _unit_rate_rows(spec)
    if spec.system_prompt_tokens:
        rows = [(t, spec.system_prompt_tokens + p, o) for t, p, o in rows]
    return rows


def _unit_rate_rows(spec: WorkloadSpec) -> list[tuple[float, int, int]]:
    if spec.arrival == "replay":
        rows = _replay_rows(spec)
        times, _ = unit_rate_times([t for t, _, _ in rows])
        return [(t, p, o) for t, (_, p, o) in zip(times, rows, strict=True)]
    rng = np.random.default_rng(spec.seed)
    lengths, limit = _lengths(spec, rng)
    max_total = spec.max_total_tokens or limit
    if max_total:
        lengths = [(p, o) for p, o in lengths if p + o <= max_total]
    if len(lengths) < spec.num_requests:
        raise ValueError(
            f"workload {spec.source}: only {len(lengths)} requests within "
            f"max_total_tokens={max_total}, {spec.num_requests} asked"
        )
    lengths = lengths[: spec.num_requests]
    n = spec.num_requests
    arrival_rng = np.random.default_rng([spec.seed, 1])  # independent of the lengths
    gaps = unit_gaps(spec.arrival, spec.burstiness, n, arrival_rng)
    times = np.cumsum(gaps).tolist()
    return [(t, p, o) for t, (p, o) in zip(times, lengths, strict=True)]


def max_total_tokens_of(spec: WorkloadSpec) -> int:
    """The longest request the workload can hold: the model length the scheduler must allow."""
    return max(p + o for _, p, o in unit_rate_requests(spec))
