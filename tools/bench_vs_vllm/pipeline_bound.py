"""How far ours' pipeline is from what its micro-batches allow, run by run, from the step log.

    PYTHONPATH=tools:. .venv/bin/python -m bench_vs_vllm.pipeline_bound RESULTS [--system S]

bubble_causes.py says what the pipeline held while a stage idled; this says which change
could give that time back, by replaying the run's own micro-batches, each stage's step taking
the time it took, with every trip between stages and through the controller taking none:
- `layer split`: the busiest stage's work less the stages' mean. No schedule of these
  micro-batches on these layers finishes sooner than the busiest stage's work; a split that
  evened the stages' work would.
- `dependencies`: the replay's time past that bound, less the time no request was in the
  system: micro-batches waiting for the one whose tokens they need (a request alone; the
  in-flight limit) or for a request to arrive while others were in flight.
- `trips`: the run's time past the replay: results and plans on the wire and in the
  controller (going ahead of results, SchedulerConfig.decode_ahead, hides these).
- `no requests`: nothing in the system, so idle, not bubble (README "Metrics").
Each as a share of the run's time (its first micro-batch sent to its last result read); with
the stages' mean work they add up to it. In the replay a micro-batch starts when the stage is
free, the stage before it has finished it, the result the controller had read last before
sending it has left the last stage, and the latest request that arrived in between has
arrived. A run at rate inf has no arrivals after its first, so the replay's only waits are
the micro-batches' own. `split_what_if` replays the same micro-batches with part of the first
stage's layers on the second, to ask what a different layer split would have given.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sarathictl.bench.metrics import union_s

from bench_vs_vllm.bubbles import (
    MicroBatchTimes,
    read_step_log,
    runs_of,
    step_log_main,
    tables_of_ours,
)
from bench_vs_vllm.servers import STEP_LOG

PARTS = ("layer split", "dependencies", "trips", "no requests")


@dataclass(frozen=True)
class PipelineTimes:
    """One run's micro-batches: seconds of the run and of three lower bounds of it."""

    wall_s: float
    """First micro-batch sent to last result read."""
    mean_work_s: float
    """The stages' busy seconds, the mean over stages: the run's time on a perfect split."""
    bound_s: float
    """The busiest stage's busy seconds."""
    replay_s: float
    """The micro-batches replayed with no trips (the module's doc)."""
    no_requests_s: float
    """Seconds of the run with no request in the system."""

    def shares(self) -> dict[str, float]:
        """PARTS as shares of wall_s; with mean_work_s / wall_s they add up to 1."""
        wall = max(self.wall_s, 1e-12)
        return {
            "layer split": (self.bound_s - self.mean_work_s) / wall,
            "dependencies": (self.replay_s - self.bound_s - self.no_requests_s) / wall,
            "trips": (self.wall_s - self.replay_s) / wall,
            "no requests": self.no_requests_s / wall,
        }


def replay_s(batches: Sequence[MicroBatchTimes], arrivals: Sequence[float]) -> float:
    """The micro-batches (in the order sent) through the stages with trips taking no time:
    seconds from the first one's sending to the last one leaving the last stage."""
    order = sorted(range(len(batches)), key=lambda j: batches[j].sent_s)
    origin = batches[order[0]].sent_s
    arrivals = sorted(arrivals)
    stage_free = [origin] * max(len(b.stage_steps) for b in batches)
    finished: dict[int, float] = {}  # batch index -> its replayed finish
    returned = sorted((b.returned_s, j) for j, b in enumerate(batches))
    for j in order:
        ready = _ready_s(batches[j].sent_s, returned, finished, arrivals, origin)
        for stage, (_end, busy) in enumerate(batches[j].stage_steps):
            ready = max(ready, stage_free[stage]) + busy
            stage_free[stage] = ready
        finished[j] = ready
    return max(finished.values()) - origin


def _ready_s(
    sent_s: float,
    returned: Sequence[tuple[float, int]],
    finished: dict[int, float],
    arrivals: Sequence[float],
    origin: float,
) -> float:
    """When a micro-batch sent at sent_s could enter the replay: after the replayed finish of
    the last result read before it was sent, and the latest arrival since that result."""
    ready, since = origin, float("-inf")
    last = bisect.bisect_right(returned, (sent_s, len(returned))) - 1
    if last >= 0:
        since, trigger = returned[last]
        ready = max(ready, finished.get(trigger, origin))
    newest = bisect.bisect_right(arrivals, sent_s) - 1
    if newest >= 0 and arrivals[newest] > since:
        ready = max(ready, arrivals[newest])
    return ready


def sent_within(
    batches: Sequence[MicroBatchTimes], spans: Sequence[tuple[float, float]]
) -> list[MicroBatchTimes]:
    """The micro-batches of the run whose requests span `spans`: those sent within the span."""
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    return [b for b in batches if lo <= b.sent_s <= hi]


def pipeline_times(
    batches: Sequence[MicroBatchTimes], spans: Sequence[tuple[float, float]]
) -> PipelineTimes | None:
    """The run whose requests span `spans` (sent_within); None when it has no micro-batch."""
    run = sent_within(batches, spans)
    if not run:
        return None
    start, end = min(b.sent_s for b in run), max(b.returned_s for b in run)
    work = [0.0] * max(len(b.stage_steps) for b in run)
    for batch in run:
        for stage, (_end, busy) in enumerate(batch.stage_steps):
            work[stage] += busy
    return PipelineTimes(
        wall_s=end - start,
        mean_work_s=sum(work) / len(work),
        bound_s=max(work),
        replay_s=replay_s(run, [s for s, _ in spans]),
        no_requests_s=(end - start) - union_s(spans, start, end),
    )


def with_layers_moved(
    batches: Sequence[MicroBatchTimes], moved: float, first_stage_layers: int
) -> list[MicroBatchTimes]:
    """Each micro-batch as it would run with `moved` of the first stage's layers on the second
    (a fraction: a boundary inside a layer), every layer of the first stage costing the same
    share of its step (its embedding is not a layer's cost, and is small)."""
    share = moved / first_stage_layers
    out = []
    for batch in batches:
        (end0, busy0), (end1, busy1), *rest = batch.stage_steps
        steps = ((end0, busy0 * (1 - share)), (end1, busy1 + busy0 * share), *rest)
        out.append(replace(batch, stage_steps=steps))
    return out


def split_what_if(
    results: Path | str, system: str, first_stage_layers: int, moved: Sequence[float]
) -> str:
    """A markdown table: each run of `system`'s replay with `moved` layers of its first stage on
    the second, as a ratio of its replay on the split it ran (pipeline_bound's doc)."""
    results = Path(results)
    batches = read_step_log(results / "stages" / system / STEP_LOG)
    lines = [
        "| run | " + " | ".join(f"{m:g} layers moved" for m in moved) + " |",
        "| --- |" + " ---: |" * len(moved),
    ]
    for run, spans in runs_of(results, system):
        mine = sent_within(batches, spans)
        if not mine:
            continue
        arrivals = [s for s, _ in spans]
        base = replay_s(mine, arrivals)
        ratios = [
            replay_s(with_layers_moved(mine, m, first_stage_layers), arrivals) / base for m in moved
        ]
        lines.append(f"| {run} | " + " | ".join(f"{r:.3f}x" for r in ratios) + " |")
    return "\n".join(lines)


def bound_table(results: Path, system: str) -> str:
    """A markdown table: every run of `system` in `results`, a row each."""
    batches = read_step_log(results / "stages" / system / STEP_LOG)
    lines = [
        "| run | time s | stages' mean work | " + " | ".join(PARTS) + " |",
        "| --- | ---: | ---: |" + " ---: |" * len(PARTS),
    ]
    for run, spans in runs_of(results, system):
        times = pipeline_times(batches, spans)
        if times is None:
            continue
        shares = times.shares()
        cells = " | ".join(f"{100 * shares[p]:.1f}%" for p in PARTS)
        work = 100 * times.mean_work_s / max(times.wall_s, 1e-12)
        lines.append(f"| {run} | {times.wall_s:.1f} | {work:.1f}% | {cells} |")
    return "\n".join(lines)


def all_bound_tables(results: Path) -> str:
    """bound_table for each system of ours in `results`, under its name; "" where there is none."""
    return tables_of_ours(results, bound_table)


def main(argv: Sequence[str] | None = None) -> int:
    return step_log_main(__doc__, bound_table, argv)


if __name__ == "__main__":
    raise SystemExit(main())
