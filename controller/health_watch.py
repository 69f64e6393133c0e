"""Keeps the gRPC health status honest. The API's status (sarathi.v1.Generation, readiness) is
SERVING only while the pipeline is up, every worker's KV cache is ready and steps complete; the
process's ("", startup and liveness) turns NOT_SERVING only for what a restart of the
controller cures: a stall, and a rebuild not done within the worker start timeout (a worker
lost mid-rebuild holds its place and its replacement is refused it; a new controller starts
with every place free). A lost stage is otherwise rebuilt, and a cache finishes preparing.

A pipeline whose stage hangs (a collective that never returns) still has an open socket; only
the absence of completed steps while requests wait tells it apart from an idle one. Kubernetes
probes read the health status and restart what is stuck. Before any of that, every worker
zeroes its KV cache after the cache assignment (tens of seconds for a large CPU cache): a
readiness probe that passed then would send requests to a pipeline that cannot run a step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from controller.engine import Engine
from controller.executor.membership import WorkerInfo
from controller.executor.pipeline import PipelineExecutor

log = logging.getLogger(__name__)

# How often the health status is re-evaluated.
_PERIOD_S = 0.25


def diagnose(engine: Engine, pipeline: PipelineExecutor, stall_timeout_s: float) -> str:
    """Why the controller should not be called serving right now; empty when it should."""
    if not pipeline.up:
        refused = f"; {pipeline.last_refusal}" if pipeline.last_refusal else ""
        down_s = time.monotonic() - pipeline.down_since_s
        return (
            f"a pipeline stage is down ({pipeline.down_reason}); rebuilding for {down_s:.0f} s"
            f"{refused}"
        )
    preparing = pipeline.preparing_cache()
    if preparing:
        return _still_preparing(preparing)
    if not stalled(engine, pipeline, stall_timeout_s):
        return ""
    stalled_s = engine.stalled_for_s()
    stage = pipeline.lagging_stage()
    where = "" if stage is None else f"; stage {stage} stopped answering"
    return f"no step completed for {stalled_s:.1f} s with requests waiting{where}"


def stalled(engine: Engine, pipeline: PipelineExecutor, stall_timeout_s: float) -> bool:
    """A pipeline that is up and ready has completed no step for stall_timeout_s while requests
    wait. (While a stage is down or a cache is being prepared nothing steps either, and that is
    not a stall.)"""
    return (
        pipeline.up and not pipeline.preparing_cache() and engine.stalled_for_s() >= stall_timeout_s
    )


def stuck(
    engine: Engine, pipeline: PipelineExecutor, stall_timeout_s: float, rebuild_timeout_s: float
) -> bool:
    """What a restart of the controller cures (liveness): a stall, or a pipeline rebuilt for
    longer than rebuild_timeout_s (the time workers have to start)."""
    overdue = not pipeline.up and time.monotonic() - pipeline.start_since_s >= rebuild_timeout_s
    return overdue or stalled(engine, pipeline, stall_timeout_s)


def _still_preparing(workers: list[WorkerInfo]) -> str:
    """Names the first worker still zeroing its KV cache, and how many more are."""
    first = workers[0]
    num_others = len(workers) - 1
    others = (
        f" (and {num_others} other worker{'s' if num_others > 1 else ''})" if num_others else ""
    )
    return (
        f"stage {first.stage} rank {first.tp_rank} (worker {first.worker_id}) is still "
        f"preparing its KV cache{others}"
    )


async def watch_health(
    engine: Engine,
    pipeline: PipelineExecutor,
    stall_timeout_s: float,
    rebuild_timeout_s: float,
    publish: Callable[[str, bool], None],
) -> None:
    """Calls publish(problem, stuck) every period ("" means serving; stuck: see `stuck`)."""
    last: str | None = None
    while True:
        problem = diagnose(engine, pipeline, stall_timeout_s)
        # The stall figure ticks every period: compare the kind of problem, not its text.
        kind = problem.split(" for ", 1)[0].split(" (", 1)[0]
        if kind != (last or "").split(" for ", 1)[0].split(" (", 1)[0] or last is None:
            if problem:
                log.error("not serving: %s", problem)
            else:
                log.info("serving")
        publish(problem, stuck(engine, pipeline, stall_timeout_s, rebuild_timeout_s))
        last = problem
        await asyncio.sleep(_PERIOD_S)
