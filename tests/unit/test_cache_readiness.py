"""The controller is not serving until every worker has reported its KV cache zeroed: a worker
zeroes a large CPU cache for tens of seconds after the cache assignment, and a readiness probe
that passed meanwhile sent traffic to a pipeline that could not run a step yet."""

from __future__ import annotations

import asyncio
from typing import cast

from sarathi_proto import generate_pb2, stage_pb2

from controller.api_request import RequestLimits
from controller.config import ParallelConfig
from controller.executor.control_channel import ControlChannel
from controller.executor.pipeline import PipelineExecutor
from controller.health_watch import diagnose
from controller.server import GenerationService, build_status
from tests.unit.test_engine import make_engine
from tests.unit.test_pipeline_rejected_plan import ScriptedChannel, wait_for


async def serving_pipeline(channel: ScriptedChannel, pp: int) -> PipelineExecutor:
    """pp stages of one rank each (worker w<stage>), through hello, ready and the cache
    assignment: up, with every worker about to zero its cache."""
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=pp, tp=1), "m", "127.0.0.1", 1
    )
    for stage in range(pp):
        identity, worker_id = f"w{stage}".encode(), f"w{stage}"
        hello = stage_pb2.WorkerHello(worker_id=worker_id, model="m", stage=stage, tp_rank=0)
        channel.worker_says(identity, hello=hello)
        channel.worker_says(identity, ready=stage_pb2.WorkerReady(num_kv_blocks=64))
    await pipeline.start(timeout_s=5)
    await pipeline.begin_serving(64, 16, lambda *result: None)
    return pipeline


def heartbeat(stage: int, cache_ready: bool) -> stage_pb2.Heartbeat:
    return stage_pb2.Heartbeat(worker_id=f"w{stage}", stage=stage, cache_ready=cache_ready)


def test_not_serving_until_every_worker_has_reported_its_cache_ready() -> None:
    async def main() -> list[str]:
        channel = ScriptedChannel()
        pipeline = await serving_pipeline(channel, pp=2)
        engine = make_engine(pp=2)[0]  # idle: never stalled

        def problem() -> str:
            return diagnose(engine, pipeline, stall_timeout_s=30.0)

        problems = [problem()]  # the cache assigned, no heartbeat yet
        channel.worker_says(b"w0", heartbeat=heartbeat(0, cache_ready=True))
        channel.worker_says(b"w1", heartbeat=heartbeat(1, cache_ready=False))  # still zeroing
        await wait_for(channel.incoming.empty, "the heartbeats read")
        problems.append(problem())
        channel.worker_says(b"w1", heartbeat=heartbeat(1, cache_ready=True))
        await wait_for(lambda: not problem(), "serving")
        problems.append(problem())
        await pipeline.shutdown()
        return problems

    assert asyncio.run(main()) == [
        "stage 0 rank 0 (worker w0) is still preparing its KV cache (and 1 other worker)",
        "stage 1 rank 0 (worker w1) is still preparing its KV cache",
        "",
    ]


def test_status_names_the_stage_whose_worker_still_prepares_its_cache() -> None:
    async def main() -> generate_pb2.StatusResponse:
        channel = ScriptedChannel()
        pipeline = await serving_pipeline(channel, pp=2)
        engine = make_engine(pp=2)[0]
        channel.worker_says(b"w0", heartbeat=heartbeat(0, cache_ready=True))
        await wait_for(channel.incoming.empty, "the heartbeat read")
        service = GenerationService("m")
        limits = RequestLimits(100, 16, 4, 64, frozenset())
        service.attach(engine, pipeline, limits, lambda messages: [])
        service.problem = diagnose(engine, pipeline, stall_timeout_s=30.0)
        status = build_status(service)
        await pipeline.shutdown()
        return status

    status = asyncio.run(main())
    assert not status.serving
    assert status.problem == "stage 1 rank 0 (worker w1) is still preparing its KV cache"
    assert [(s.stage, s.up, s.preparing_cache) for s in status.stages] == [
        (0, True, False),
        (1, True, True),
    ]
