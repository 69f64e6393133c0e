"""The controller is not serving until every worker has reported its KV cache zeroed: a worker
zeroes a large CPU cache for tens of seconds after the cache assignment, and a readiness probe
that passed meanwhile sent traffic to a pipeline that could not run a step yet."""

from __future__ import annotations

import asyncio
from typing import Any, cast

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


def test_a_stall_alone_marks_the_process_unhealthy() -> None:
    """Liveness (the empty health name) restarts the controller on a stall only: a stage that
    is down or a cache being prepared is the controller's to wait out, not a reason to restart
    it; readiness (the API's name) is off for all three."""
    from controller.health_watch import stalled

    class Engine:
        stalled_s = 0.0

        def stalled_for_s(self) -> float:
            return self.stalled_s

    class Pipeline:
        def __init__(self) -> None:
            self.up = True
            self.preparing: list[object] = []

        def preparing_cache(self) -> list[object]:
            return self.preparing

    engine, pipeline = Engine(), Pipeline()
    assert not stalled(cast(Any, engine), cast(Any, pipeline), 30.0)
    engine.stalled_s = 31.0
    assert stalled(cast(Any, engine), cast(Any, pipeline), 30.0)
    pipeline.up = False  # nothing steps while a stage is down: not a stall
    assert not stalled(cast(Any, engine), cast(Any, pipeline), 30.0)
    pipeline.up, pipeline.preparing = True, [object()]
    assert not stalled(cast(Any, engine), cast(Any, pipeline), 30.0)


def test_a_rebuild_past_the_worker_start_timeout_marks_the_process_unhealthy() -> None:
    """A worker lost mid-rebuild holds its place and its replacement is refused it: the
    pipeline would stay down for good. Past the time workers have to start, liveness fails,
    so that the controller is restarted and a new one starts with every place free."""
    import time

    from controller.health_watch import stuck

    class Engine:
        def stalled_for_s(self) -> float:
            return 0.0

    class Pipeline:
        up = False
        start_since_s = time.monotonic() - 10.0  # the rebuild's start, or its last start-over

        def preparing_cache(self) -> list[object]:
            return []

    engine, pipeline = Engine(), Pipeline()
    assert not stuck(cast(Any, engine), cast(Any, pipeline), 30.0, 300.0)  # rebuilding
    pipeline.start_since_s = time.monotonic() - 301.0
    assert stuck(cast(Any, engine), cast(Any, pipeline), 30.0, 300.0)
    pipeline.up = True  # rebuilt: start_since_s no longer counts
    assert not stuck(cast(Any, engine), cast(Any, pipeline), 30.0, 300.0)


def test_the_process_and_the_api_have_health_names_of_their_own() -> None:
    """At start the process serves ("", what startup and liveness probes ask) and the API does
    not (sarathi.v1.Generation, readiness); each changes alone."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from controller.server import SERVICE_NAME, mark_alive, mark_serving, start_grpc_server

    async def main() -> list[tuple[int, int]]:
        service = GenerationService("m")
        server, port, health = await start_grpc_server(service, "127.0.0.1", 0)
        seen = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def both() -> tuple[int, int]:
                process = await stub.Check(health_pb2.HealthCheckRequest(service=""))
                api = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                return process.status, api.status

            seen.append(await both())
            mark_serving(health, True)
            seen.append(await both())
            mark_alive(health, False)
            seen.append(await both())
        await server.stop(None)
        return seen

    serving, not_serving = 1, 2
    assert asyncio.run(main()) == [
        (serving, not_serving),
        (serving, serving),
        (not_serving, serving),
    ]
