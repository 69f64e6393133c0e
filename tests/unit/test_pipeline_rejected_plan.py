"""The controller's side of a plan the workers reject, without processes: the `rejected` result
that answers it takes the pipeline down naming the micro-batch (so it is rebuilt, the requests
recomputed and those of that micro-batch quarantined), also when no token was due from it, and
the receive loop goes on reading, where it used to die on the scheduler's exception and leave a
controller that heard no result, heartbeat or hello again."""

from __future__ import annotations

import asyncio
from typing import cast

from sarathi_proto import stage_pb2

from controller.config import ParallelConfig
from controller.engine import Engine
from controller.executor.control_channel import ControlChannel
from controller.executor.pipeline import PipelineExecutor
from tests.unit.test_engine import CharStream, make_engine, request


class ScriptedChannel:
    """Workers' messages queued by the test; what the controller sends is kept."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[tuple[bytes, stage_pb2.WorkerMessage]] = asyncio.Queue()
        self.plans: list[int] = []
        self.received_at = 0.0

    async def recv(self) -> tuple[bytes, stage_pb2.WorkerMessage]:
        return await self.incoming.get()

    async def send(self, identity: bytes, msg: stage_pb2.ControllerMessage) -> None:
        await self.send_bytes(identity, msg.SerializeToString())

    async def send_bytes(self, identity: bytes, payload: bytes) -> None:
        msg = stage_pb2.ControllerMessage.FromString(payload)
        if msg.HasField("plan"):
            self.plans.append(msg.plan.batch_id)

    def worker_says(self, identity: bytes, **body: object) -> None:
        self.incoming.put_nowait((identity, stage_pb2.WorkerMessage(**body)))  # type: ignore[arg-type]


async def wait_for(predicate: object, what: str) -> None:
    for _ in range(200):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} did not happen")


def test_a_rejection_takes_the_pipeline_down_naming_the_batch_and_hellos_are_still_read() -> None:
    async def main() -> None:
        channel = ScriptedChannel()
        pipeline = PipelineExecutor(
            cast(ControlChannel, channel), ParallelConfig(pp=1, tp=1), "m", "127.0.0.1", 1
        )
        channel.worker_says(b"w1", hello=stage_pb2.WorkerHello(worker_id="w1", model="m"))
        channel.worker_says(b"w1", ready=stage_pb2.WorkerReady(num_kv_blocks=64))
        await pipeline.start(timeout_s=5)
        scheduler = make_engine()[0].scheduler
        engine = Engine(scheduler, pipeline, lambda r: CharStream(r.stop))
        downs: list[str] = []

        def down(reason: str) -> None:
            downs.append(reason)
            engine.on_pipeline_down()

        pipeline.on_down = down
        pipeline.on_step_fault = engine.on_step_fault
        await pipeline.begin_serving(64, 16, engine.on_result)
        loop = asyncio.create_task(engine.run())
        # 50 prompt tokens at a budget of 32: the first micro-batch yields no token.
        handle = engine.add(request("r", prompt_len=50, max_tokens=4))
        await wait_for(lambda: channel.plans, "a plan sent")
        refused = stage_pb2.StepResult(batch_id=channel.plans[0], rejected=True)
        channel.worker_says(b"w1", result=refused)
        await wait_for(lambda: downs, "the pipeline going down")
        assert f"rejected the plan of micro-batch {channel.plans[0]}" in downs[0]
        assert not pipeline.up and not engine.pipeline_up
        assert scheduler.num_waiting == 1 and handle.events.empty()  # requeued, not lost
        assert list(scheduler.quarantine.suspects) == [1]  # to run alone first
        # Still listening: the restarted worker's hello is read and given its place.
        channel.worker_says(b"w2", hello=stage_pb2.WorkerHello(worker_id="w2", model="m"))
        await wait_for(lambda: [w.worker_id for w in pipeline.workers] == ["w2"], "w2 placed")
        assert all(not task.done() for task in pipeline.tasks)
        loop.cancel()
        await pipeline.shutdown()

    asyncio.run(main())
