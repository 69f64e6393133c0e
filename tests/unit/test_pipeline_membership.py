"""Who may join a pipeline: places, the model check, and refusals an operator can see."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from sarathi_proto import stage_pb2

from controller.config import ParallelConfig
from controller.executor.control_channel import ControlChannel
from controller.executor.membership import PipelineSlots
from controller.executor.pipeline import PipelineExecutor
from controller.health_watch import diagnose


def hello(stage: int = -1, rank: int = -1, model: str = "m", worker: str = "w") -> Any:
    return stage_pb2.WorkerHello(
        worker_id=worker, host="10.0.0.9", stage=stage, tp_rank=rank, model=model
    )


def test_workers_without_a_place_fill_the_free_ones_in_order() -> None:
    slots = PipelineSlots(pp=2, tp=2, model="m")
    places = [slots.claim(bytes([i]), hello(worker=f"w{i}")) for i in range(4)]
    assert [(p.stage, p.tp_rank) for p in places] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert slots.full
    with pytest.raises(ValueError, match="all 4 places of the pipeline are taken"):
        slots.claim(b"x", hello())


@pytest.mark.parametrize(
    ("worker", "message"),
    [
        (hello(model="other"), "worker serves model 'other', the cluster 'm'"),
        (hello(stage=2, rank=0), "asked for stage 2 rank 0; the cluster has pp=2 stages of tp=1"),
        (hello(stage=0, rank=0, worker="late"), "stage 0 rank 0 is already served by w"),
    ],
)
def test_a_worker_that_cannot_serve_is_refused_naming_why(worker: Any, message: str) -> None:
    slots = PipelineSlots(pp=2, tp=1, model="m")
    slots.claim(b"first", hello(stage=0, rank=0))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        slots.claim(b"second", worker)
    assert len(slots.workers) == 1  # the refused worker holds nothing


class RecordingChannel:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, stage_pb2.ControllerMessage]] = []

    async def send(self, identity: bytes, msg: stage_pb2.ControllerMessage) -> None:
        self.sent.append((identity, msg))


def test_a_refused_worker_is_told_why_and_the_reason_reaches_status() -> None:
    channel = RecordingChannel()
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=2, tp=1), "m", "", 29500
    )
    seen: list[str] = []
    pipeline.on_refused = seen.append
    asyncio.run(pipeline._on_hello(b"w1", hello(model="falcon-7b", worker="w1")))

    ((identity, message),) = channel.sent
    assert identity == b"w1" and message.WhichOneof("body") == "reject"
    assert "worker serves model 'falcon-7b', the cluster 'm'" in message.reject.reason
    assert seen == [f"refused worker w1 from 10.0.0.9: {message.reject.reason}"]
    # While the pipeline is not up, the health diagnosis (Status.problem) carries the refusal.
    problem = diagnose(cast(Any, None), pipeline, stall_timeout_s=30.0)
    assert "refused worker w1 from 10.0.0.9: worker serves model 'falcon-7b'" in problem
