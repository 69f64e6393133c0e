"""Each stage's utilization, bubble and idle right now, and its step phases, for `Status` and
for Prometheus."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from sarathi_proto import generate_pb2

from controller.engine import Engine
from controller.telemetry import StageShares

if TYPE_CHECKING:  # the executor pulls in zmq; the gRPC service is tested without it
    from sarathi_proto import stage_pb2

    from controller.executor.pipeline import PipelineExecutor

# How often the Prometheus gauges of the stages are brought up to date.
_METRICS_PERIOD_S = 1.0


def stage_shares(engine: Engine, pipeline: PipelineExecutor, now: float) -> list[StageShares]:
    """Per stage, in stage order, over the recent window (or since the pipeline started)."""
    since = pipeline.started_at
    work_s = engine.work.work_s(now, since)
    return [
        StageShares.of(stage.busy_s(now), work_s, min(stage.window_s, now - since))
        for stage in pipeline.stages
    ]


def public_phases(phases: stage_pb2.StepPhases | None) -> generate_pb2.StagePhases:
    """A worker's step phases (Heartbeat) as Status reports them: the public message has the same
    fields with the same numbers and types (tests/unit/test_step_phases.py), so the bytes carry
    over as they are."""
    public = generate_pb2.StagePhases()
    if phases is not None:
        public.ParseFromString(phases.SerializeToString())
    return public


async def publish_stage_metrics(engine: Engine, pipeline: PipelineExecutor) -> None:
    """Keeps the stage gauges current between scrapes (they are windows, not counters)."""
    if engine.metrics is None:
        return
    while True:
        now = engine.clock()
        engine.metrics.on_stages(
            stage_shares(engine, pipeline, now), [s.busy_s_total for s in pipeline.stages]
        )
        await asyncio.sleep(_METRICS_PERIOD_S)
