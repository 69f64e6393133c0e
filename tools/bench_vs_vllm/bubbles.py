"""Each pipeline stage's bubble in one run, measured the same way for both servers.

A bubble is a stage idle while some request is in the system (README "Metrics";
sarathictl/bench/metrics.py holds the formula, used here as it is). What each server gives:
- its stages' steps, each as (end, busy seconds) on perf_counter's clock: ours from the
  controller's `--step-log` (each stage's `work_s`, ended when the controller read the stage's
  report), vLLM's from stage_hook/sitecustomize.py (each call's time less its waits for
  activations);
- the client's requests, each as (start, start + latency) on the same clock (`vllm bench
  serve --save-detailed` saves both).
A run's window is its first start to its last finish; the steady state is the middle 80% of
its arrivals (controller.executor.simulated.steady_window), as every benchmark here reports.

Part of a steady-state bubble is spent with one request alone in the system. While it decodes,
its tokens follow one another, so a pipeline holds one micro-batch and each stage waits while
the others run it: no schedule fills that. (Its prompt's chunks can overlap, where a server
pipelines them, as ours does.) The lighter the load, the larger this part; the report gives it
beside the bubble (`steady_lone_fraction`), for both servers alike, from the requests' spans.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sarathictl.bench.metrics import BusyWindow, bubble_fraction, union_s, window_shares

from bench_vs_vllm.servers import STEP_LOG
from controller.executor.simulated import steady_window

Steps = list[tuple[float, float]]
"""One stage's steps: (end_s, busy_s) each."""


@dataclass(frozen=True)
class RunBubbles:
    bubble_fraction: float
    """Bubble over busy plus bubble, the mean over stages, over the whole run."""
    steady_bubble_fraction: float
    """The same over the middle 80% of the arrivals; NaN where they came at once (that span
    under a tenth of the run's: rate inf), which leaves no steady state to measure."""
    stage_busy_s: tuple[float, ...]
    """Each stage's busy seconds in the run."""
    steady_lone_fraction: float = math.nan
    """Of the steady-state bubble fraction, the part spent with one request alone in the system
    (lone_spans), over the same busy plus bubble; NaN where there is no steady state."""


def stage_steps(folder: Path) -> list[Steps]:
    """A server's stages' steps from its stage_log folder (servers.ServerSpec.stage_log)."""
    step_log = folder / STEP_LOG
    return sarathi_stage_steps(step_log) if step_log.is_file() else vllm_stage_steps(folder)


def vllm_stage_steps(folder: Path) -> list[Steps]:
    """The steps stage_hook wrote (`stage-<pid>.tsv`: rank, end, busy), by pipeline rank."""
    by_rank: dict[int, Steps] = {}
    for path in sorted(folder.glob("stage-*.tsv")):
        for line in path.read_text().splitlines():
            rank, end, busy = line.split("\t")
            by_rank.setdefault(int(rank), []).append((float(end), float(busy)))
    return [by_rank[r] for r in sorted(by_rank)]


@dataclass(frozen=True)
class MicroBatchTimes:
    """One micro-batch of ours' step log (controller/step_log.py), on perf_counter's clock."""

    sent_s: float
    returned_s: float
    stage_steps: tuple[tuple[float, float], ...]
    """Each stage's step on it as (end_s, busy_s), as Steps holds them. The end is when the
    controller read the stage's report of it (`reported_s`): a little after the step ended,
    which shifts each stage's busy time late by the report's trip."""
    carries_prompt: bool


def read_step_log(step_log: Path) -> list[MicroBatchTimes]:
    """Ours' micro-batches from the controller's step log, in the order written."""
    batches = []
    for text in step_log.read_text().splitlines():
        if not text.strip():
            continue
        line = json.loads(text)
        opened = line["opened_at_s"]
        steps = tuple((opened + s["reported_s"], s["work_s"]) for s in line["stages"])
        batches.append(
            MicroBatchTimes(
                opened + line["sent_s"], opened + line["returned_s"], steps,
                line["prompt_tokens"] > 0,
            )
        )  # fmt: skip
    return batches


def sarathi_stage_steps(step_log: Path) -> list[Steps]:
    """Each stage's steps from the controller's step log."""
    stages: list[Steps] = []
    for batch in read_step_log(step_log):
        for index, step in enumerate(batch.stage_steps):
            while len(stages) <= index:
                stages.append([])
            stages[index].append(step)
    return stages


def request_spans(result: dict[str, object]) -> list[tuple[float, float]]:
    """(start, finish) of every request of a `vllm bench serve --save-detailed` result."""
    starts, latencies = result.get("start_times"), result.get("latencies")
    if not isinstance(starts, list) or not isinstance(latencies, list):
        raise ValueError("the result has no start_times and latencies (--save-detailed)")
    return [(float(s), float(s) + float(lat)) for s, lat in zip(starts, latencies, strict=True)]


def busy_in(steps: Steps, lo: float, hi: float) -> float:
    """Busy seconds of [lo, hi]: each step's busy time ends at its end."""
    return sum(max(0.0, min(end, hi) - max(end - busy, lo)) for end, busy in steps)


def lone_spans(
    spans: Sequence[tuple[float, float]], lo: float, hi: float
) -> list[tuple[float, float]]:
    """The stretches of [lo, hi] with exactly one request in the system (a request that ends
    as another starts leaves it alone from then)."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    alone: list[tuple[float, float]] = []
    count, since = 0, 0.0
    for at, change in events:
        if count == 1 and at > since:
            alone.append((max(since, lo), min(at, hi)))
        count += change
        since = at
    return [(start, end) for start, end in alone if end > start]


def lone_fraction(
    stages: Sequence[Steps], spans: Sequence[tuple[float, float]], lo: float, hi: float
) -> float:
    """Each stage's idle time in [lo, hi] while one request was alone in the system, over its
    busy plus bubble time there (bubble_fraction's denominator), the mean over stages. At most
    the stage's bubble (a stage busy with no request in the system has less bubble than idle
    time)."""
    alone = lone_spans(spans, lo, hi)
    alone_s = sum(end - start for start, end in alone)
    work_s = union_s(spans, lo, hi)
    shares = []
    for steps in stages:
        busy_s = busy_in(steps, lo, hi)
        idle_alone_s = alone_s - sum(busy_in(steps, start, end) for start, end in alone)
        bubble_s = max(0.0, work_s - busy_s)
        shares.append(min(max(0.0, idle_alone_s), bubble_s) / max(busy_s, work_s, 1e-12))
    return sum(shares) / len(shares) if shares else 0.0


def run_bubbles(stages: Sequence[Steps], spans: Sequence[tuple[float, float]]) -> RunBubbles:
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    busy = tuple(busy_in(steps, lo, hi) for steps in stages)
    whole = bubble_fraction(window_shares(BusyWindow(lo, hi, busy), spans))
    steady_lo, steady_hi = steady_window(sorted(s for s, _ in spans))
    steady = lone = math.nan
    if steady_hi - steady_lo >= 0.1 * (hi - lo):
        steady_busy = tuple(busy_in(steps, steady_lo, steady_hi) for steps in stages)
        steady = bubble_fraction(
            window_shares(BusyWindow(steady_lo, steady_hi, steady_busy), spans)
        )
        lone = lone_fraction(stages, spans, steady_lo, steady_hi)
    return RunBubbles(whole, steady, busy, lone)


def runs_of(results: Path, system: str) -> Iterator[tuple[str, list[tuple[float, float]]]]:
    """Each run of `system` in a results folder, in name order: its name (workload_rate) and
    its requests' spans (request_spans)."""
    for raw in sorted((results / "raw").glob(f"{system}_*.json")):
        if not raw.name.endswith(".stages.json"):
            run = raw.stem.removeprefix(f"{system}_")
            yield run, request_spans(json.loads(raw.read_text()))


SystemTable = Callable[[Path, str], str]
"""A markdown table of one system's runs in a results folder: (results, system) -> table."""


def tables_of_ours(results: Path, table: SystemTable) -> str:
    """`table` for each system of ours in `results` (each with a step log), under its name; ""
    where there is none."""
    stages = results / "stages"
    names = sorted(f.name for f in stages.glob("*") if (f / STEP_LOG).is_file())
    return "\n\n".join(f"{name}:\n\n{table(results, name)}" for name in names)


def step_log_main(doc: str, table: SystemTable, argv: Sequence[str] | None) -> int:
    """The command line of a step-log analysis: RESULTS [--system S] prints S's table."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a `make bench-vs-vllm` results folder")
    p.add_argument("--system", default="sarathi-pp2", help="ours' system's name there")
    args = p.parse_args(argv)
    step_log = args.results / "stages" / args.system / STEP_LOG
    if not step_log.is_file():
        p.error(f"{step_log}: no step log (was {args.system} run there?)")
    print(table(args.results, args.system))
    return 0
