"""Who may join a pipeline and when it is down: places, the model check, refusals and lost
workers as an operator sees them."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest
import zmq
from sarathi_proto import stage_pb2

from controller.config import ParallelConfig
from controller.executor.control_channel import ControlChannel
from controller.executor.membership import PipelineSlots
from controller.executor.pipeline import _WATCH_PERIOD_S, PipelineExecutor
from controller.health_watch import diagnose
from controller.scheduler import MicroBatch


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


class GoneWorkersChannel(RecordingChannel):
    """A ROUTER socket whose peers in `gone` have disconnected (ROUTER_MANDATORY raises)."""

    def __init__(self, gone: set[bytes]) -> None:
        super().__init__()
        self.gone = gone

    async def send_bytes(self, identity: bytes, payload: bytes) -> None:
        if identity in self.gone:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        self.sent.append((identity, stage_pb2.ControllerMessage.FromString(payload)))


def test_a_plan_that_finds_workers_gone_names_every_one_of_them() -> None:
    # Stage 1 is killed; stage 0 exits too once its link breaks. The status must name stage 1,
    # although stage 0 comes first in send order.
    channel = GoneWorkersChannel(gone={b"s0", b"s1"})
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=3, tp=1), "m", "", 29500
    )
    for stage in range(3):
        pipeline.slots.claim(f"s{stage}".encode(), hello(stage=stage, rank=0))
    pipeline.up = True
    asyncio.run(pipeline.submit(MicroBatch(1, [], [], 0)))

    assert not pipeline.up
    assert "stage 0 rank 0 unreachable" in pipeline.down_reason
    assert "stage 1 rank 0 unreachable" in pipeline.down_reason
    assert "stage 2" not in pipeline.down_reason
    # Every worker still reachable was told to exit, so the whole pipeline is rebuilt.
    assert [(i, m.WhichOneof("body")) for i, m in channel.sent][-1] == (b"s2", "shutdown")


def test_pings_carry_each_stages_progress_and_stop_once_a_worker_is_silent() -> None:
    # A worker waiting on its neighbour waits on while the pings say that neighbour is still
    # stepping; a ping must therefore never go out while any worker is silent.
    channel = GoneWorkersChannel(gone=set())
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=2, tp=1), "m", "", 29500
    )
    for stage in range(2):
        pipeline.slots.claim(f"s{stage}".encode(), hello(stage=stage, rank=0))
    pipeline.up = True
    now = time.monotonic()
    for info in pipeline.slots.workers.values():
        info.last_seen_s = now
    pipeline.stages[0].on_heartbeat(now, 9, 0.1, 1.0)
    pipeline.stages[1].on_heartbeat(now, 8, 0.1, 1.0)

    async def one_round() -> None:
        """The watch's first look: until it has sent its two messages (5 s at most, on a
        loaded machine), then stopped."""
        watch = asyncio.create_task(pipeline._watch())
        for _ in range(100):
            await asyncio.sleep(_WATCH_PERIOD_S / 10)
            if len(channel.sent) >= 2:
                break
        watch.cancel()

    asyncio.run(one_round())
    pings = [(i, list(m.ping.last_batch_ids)) for i, m in channel.sent]
    assert pings[:2] == [(b"s0", [9, 8]), (b"s1", [9, 8])]

    channel.sent.clear()
    pipeline.slots.workers[(1, 0)].last_seen_s = now - 60.0
    asyncio.run(one_round())
    assert not pipeline.up and "stage 1 rank 0 (w) sent no heartbeat" in pipeline.down_reason
    assert [m.WhichOneof("body") for _, m in channel.sent] == ["shutdown", "shutdown"]


def run_hellos(pipeline: PipelineExecutor, *hellos: tuple[bytes, Any]) -> None:
    async def main() -> None:
        for identity, message in hellos:
            await pipeline._on_hello(identity, message)

    asyncio.run(main())


def bodies_to(channel: RecordingChannel, identity: bytes) -> list[str | None]:
    return [m.WhichOneof("body") for i, m in channel.sent if i == identity]


def test_a_place_held_by_a_worker_gone_mid_rebuild_goes_to_its_successor() -> None:
    """Killed after its hello, before the others came: its place is freed for the restarted
    worker (it was refused as "already served" until its restart budget ran out)."""
    channel = GoneWorkersChannel(gone=set())
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=2, tp=1), "m", "", 29500
    )
    run_hellos(pipeline, (b"dead", hello(stage=1, rank=0, worker="dead")))
    channel.gone.add(b"dead")
    run_hellos(pipeline, (b"new", hello(stage=1, rank=0, worker="new")))
    assert pipeline.slots.workers[(1, 0)].worker_id == "new"
    assert "reject" not in bodies_to(channel, b"new")
    # A holder that is there (a busy worker) keeps its place: the newcomer is refused.
    run_hellos(pipeline, (b"other", hello(stage=1, rank=0, worker="other")))
    assert bodies_to(channel, b"other") == ["reject"]
    assert pipeline.slots.workers[(1, 0)].worker_id == "new"


def test_once_the_places_were_assigned_a_gone_worker_starts_the_rebuild_over() -> None:
    channel = GoneWorkersChannel(gone=set())
    ports = iter([29601, 29602])
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=2, tp=1), "m", "", 29500,
        new_dist_port=lambda: next(ports),
    )  # fmt: skip
    run_hellos(
        pipeline,
        (b"s0", hello(stage=0, rank=0, worker="s0")),
        (b"dead", hello(stage=1, rank=0, worker="dead")),
    )
    assert bodies_to(channel, b"s0") == ["ping", "assignment"]  # joins torch.distributed
    channel.gone.add(b"dead")
    started = pipeline.start_since_s
    run_hellos(pipeline, (b"new", hello(stage=1, rank=0, worker="new")))
    assert bodies_to(channel, b"s0")[-1] == "shutdown"  # to start over
    assert list(pipeline.slots.workers) == [(1, 0)] and pipeline.dist_port == 29601
    assert pipeline.start_since_s > started  # liveness gives the new start-up its whole time
    assert "dead) is gone, and new asks for a place" in pipeline.down_reason
    run_hellos(pipeline, (b"s0b", hello(stage=0, rank=0, worker="s0b")))
    assignment = [m for i, m in channel.sent if i == b"new"][-1].assignment
    assert assignment.dist_init_method.endswith(":29601")


def test_while_up_a_successor_saying_hello_takes_the_gone_workers_stage_down() -> None:
    channel = GoneWorkersChannel(gone=set())
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=2, tp=1), "m", "", 29500
    )
    for stage in range(2):
        pipeline.slots.claim(f"s{stage}".encode(), hello(stage=stage, rank=0, worker=f"s{stage}"))
    pipeline.up = True
    downs: list[str] = []
    pipeline.on_down = downs.append
    channel.gone.add(b"s1")
    run_hellos(pipeline, (b"new", hello(stage=1, rank=0, worker="new")))
    assert not pipeline.up and downs == ["stage 1 rank 0 (s1) is gone, and new asks for a place"]
    assert pipeline.down_stages == (1,)
    assert pipeline.slots.workers[(1, 0)].worker_id == "new"


def test_a_fault_report_from_a_worker_of_an_earlier_pipeline_does_not_take_this_one_down() -> None:
    """Its micro-batch is still the engine's to quarantine (the requeue may have come first)."""
    channel = GoneWorkersChannel(gone=set())
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=1, tp=1), "m", "", 29500
    )
    pipeline.slots.claim(b"s0", hello(stage=0, rank=0))
    pipeline.up = True
    faults: list[tuple[int, str]] = []
    pipeline.on_step_fault = lambda batch_id, reason: faults.append((batch_id, reason))
    fault = stage_pb2.StepFault(batch_id=7, stage=0, tp_rank=0, error="RuntimeError: boom")
    asyncio.run(pipeline._on_fault(fault, current=False))
    assert pipeline.up and faults == [
        (7, "stage 0 rank 0 failed micro-batch 7: RuntimeError: boom")
    ]
    asyncio.run(pipeline._on_fault(fault, current=True))
    assert not pipeline.up and "failed micro-batch 7: RuntimeError: boom" in pipeline.down_reason


def test_a_worker_gone_before_the_places_are_assigned_is_not_assigned_a_place() -> None:
    """Killed after its hello, its successor asking for any place takes another one: the dead
    one is found when the places are full, before anyone joins torch.distributed with it."""
    channel = GoneWorkersChannel(gone=set())
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=2, tp=1), "m", "", 29500
    )
    run_hellos(pipeline, (b"dead", hello(worker="dead")))
    channel.gone.add(b"dead")
    run_hellos(pipeline, (b"new", hello(worker="new")))
    assert [w.worker_id for w in pipeline.workers] == ["new"]
    assert "assignment" not in bodies_to(channel, b"new")
    run_hellos(pipeline, (b"third", hello(worker="third")))
    assert bodies_to(channel, b"new")[-1] == bodies_to(channel, b"third")[-1] == "assignment"


def test_a_busy_workers_full_queue_is_not_a_gone_worker() -> None:
    class FullChannel(RecordingChannel):
        async def send_bytes(self, identity: bytes, payload: bytes) -> None:
            raise zmq.Again()

    pipeline = PipelineExecutor(
        cast(ControlChannel, FullChannel()), ParallelConfig(pp=1, tp=1), "m", "", 29500
    )
    info = pipeline.slots.claim(b"busy", hello(stage=0, rank=0))
    assert asyncio.run(pipeline._reachable(info))


def test_no_place_is_freed_between_every_worker_ready_and_serving() -> None:
    """The pipeline is about to serve: its watch, not a hello, finds a worker gone then."""
    channel = GoneWorkersChannel(gone={b"s0"})
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=1, tp=1), "m", "", 29500
    )
    pipeline.slots.claim(b"s0", hello(stage=0, rank=0, worker="s0"))
    pipeline._all_ready.set()
    run_hellos(pipeline, (b"new", hello(stage=0, rank=0, worker="new")))
    assert pipeline.slots.workers[(0, 0)].worker_id == "s0"
    assert bodies_to(channel, b"new") == ["reject"]


def test_while_starting_the_watch_pings_every_place_holder_and_frees_the_gone() -> None:
    """Waiting workers hear the controller is there; one killed meanwhile is found without a
    successor's hello."""
    channel = GoneWorkersChannel(gone=set())
    pipeline = PipelineExecutor(
        cast(ControlChannel, channel), ParallelConfig(pp=3, tp=1), "m", "", 29500
    )
    run_hellos(
        pipeline,
        (b"s0", hello(stage=0, rank=0, worker="s0")),
        (b"dead", hello(stage=1, rank=0, worker="dead")),
    )
    channel.gone.add(b"dead")
    asyncio.run(pipeline._ping_while_down())
    assert bodies_to(channel, b"s0") == ["ping"]
    assert list(pipeline.slots.workers) == [(0, 0)]
    assert not pipeline.up
