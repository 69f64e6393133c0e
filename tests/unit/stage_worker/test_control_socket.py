"""The worker's control socket seen from the controller's end: while a step runs the worker
says it lives, and while the step waits on a neighbour the controller's pings decide whether
the wait is the neighbour's work (renewed) or a cut link (left to the watchdog); what else the
controller sent meanwhile reaches the main thread in order."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import zmq
from sarathi_proto import stage_pb2

from stage_worker.control_socket import BUSY_KEEPALIVE_S, ControlSocket, PeerWait
from stage_worker.step_timer import clock

WAIT_S = 20 * BUSY_KEEPALIVE_S  # the longest any test below waits for the thread


@pytest.mark.parametrize(
    ("progress", "busy"),
    [
        ([7, 4], True),  # stage 0 waits on stage 1, which has finished 4 of the 6 it needs
        ([7, 6], False),  # stage 1 is done with micro-batch 6: a wait past that is the link
        ([7, 9], False),
        ([7], False),  # a controller that knows of no stage 1 says nothing for it
    ],
)
def test_a_neighbour_is_busy_until_it_finishes_the_micro_batch_waited_for(
    progress: list[int], busy: bool
) -> None:
    assert PeerWait(neighbour=1, batch_id=6).neighbour_busy(progress) is busy


@pytest.fixture
def link() -> Iterator[tuple[zmq.Socket, ControlSocket]]:
    ctx = zmq.Context.instance()
    controller = ctx.socket(zmq.ROUTER)
    address = f"inproc://control-socket-{uuid.uuid4().hex}"  # inproc unbinds lazily
    controller.bind(address)
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    control = ControlSocket(sock)
    control.start()
    try:
        yield controller, control
    finally:
        control.stop()
        control.close()
        controller.close(linger=0)


def _identity(controller: zmq.Socket, control: ControlSocket) -> bytes:
    control.send(stage_pb2.WorkerMessage(alive=True))
    identity, _ = controller.recv_multipart()
    return bytes(identity)


def _ping(controller: zmq.Socket, identity: bytes, *last_batch_ids: int) -> None:
    msg = stage_pb2.ControllerMessage(ping=stage_pb2.Ping(last_batch_ids=last_batch_ids))
    controller.send_multipart([identity, msg.SerializeToString()])


class Calls(list[str]):
    """What the keepalive thread called (an exception there is logged, not raised here)."""

    def to(self, name: str) -> Callable[[], None]:
        return lambda: self.append(name)


def _until(done: object) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def test_a_busy_worker_says_it_lives_and_an_idle_one_does_not(
    link: tuple[zmq.Socket, ControlSocket],
) -> None:
    controller, control = link
    _identity(controller, control)
    with control.busy():
        assert controller.poll(int(WAIT_S * 1000))
        _, payload = controller.recv_multipart()
        assert stage_pb2.WorkerMessage.FromString(payload).alive
    while controller.poll(int(3 * BUSY_KEEPALIVE_S * 1000)):
        controller.recv_multipart()  # one may have been on its way as the step ended
    assert not controller.poll(int(3 * BUSY_KEEPALIVE_S * 1000))


def test_pings_renew_a_wait_only_while_the_neighbour_is_behind(
    link: tuple[zmq.Socket, ControlSocket],
) -> None:
    controller, control = link
    identity = _identity(controller, control)
    renewals = Calls()
    with control.busy(), control.hearing(PeerWait(0, 5), renewals.to("busy"), renewals.to("down")):
        _ping(controller, identity, 4, 3)  # stage 0 still steps micro-batch 5
        _until(lambda: renewals)
        assert renewals == ["busy"]
        _ping(controller, identity, 5, 4)  # it finished 5; the activations should be here
        heard = control.heard_s
        _until(lambda: control.heard_s > heard)
        time.sleep(2 * BUSY_KEEPALIVE_S)
    assert renewals == ["busy"]
    assert control.recv(0.0) is None  # pings are the thread's, not the main thread's


def test_messages_read_during_a_wait_reach_the_main_thread_in_order(
    link: tuple[zmq.Socket, ControlSocket],
) -> None:
    controller, control = link
    identity = _identity(controller, control)
    plans = [stage_pb2.ControllerMessage(plan=stage_pb2.StepPlan(batch_id=i)) for i in (7, 8)]
    calls = Calls()
    with control.busy(), control.hearing(PeerWait(0, 6), calls.to("busy"), calls.to("down")):
        controller.send_multipart([identity, plans[0].SerializeToString()])
        _ping(controller, identity, 6)  # stage 0 finished micro-batch 6: no renewal
        heard = control.heard_s
        _until(lambda: control.heard_s > heard)
        time.sleep(2 * BUSY_KEEPALIVE_S)  # the thread has read both by now
    controller.send_multipart([identity, plans[1].SerializeToString()])
    shutdown = stage_pb2.ControllerMessage(shutdown=True)
    controller.send_multipart([identity, shutdown.SerializeToString()])
    assert calls == []  # neither a renewal (stage 0 is done with 6) nor the pipeline down
    received = [control.recv(WAIT_S) for _ in range(3)]
    assert [m.WhichOneof("body") if m else None for m in received] == ["plan", "plan", "shutdown"]
    assert [m.plan.batch_id for m in received[:2] if m] == [7, 8]


def test_a_kept_plan_starts_its_step_when_the_main_thread_takes_it(
    link: tuple[zmq.Socket, ControlSocket],
) -> None:
    # The step timer starts a step at received_at: a plan read during the step before must not
    # date the next step back into that one.
    controller, control = link
    identity = _identity(controller, control)
    plan = stage_pb2.ControllerMessage(plan=stage_pb2.StepPlan(batch_id=3))
    calls = Calls()
    with control.busy(), control.hearing(PeerWait(0, 2), calls.to("busy"), calls.to("down")):
        controller.send_multipart([identity, plan.SerializeToString()])
        heard = control.heard_s
        _until(lambda: control.heard_s > heard)
    taken = clock()
    assert calls == []
    assert control.recv(0.0) == plan
    assert control.received_at >= taken


def test_a_shutdown_during_a_wait_says_the_pipeline_is_down(
    link: tuple[zmq.Socket, ControlSocket],
) -> None:
    controller, control = link
    identity = _identity(controller, control)
    calls = Calls()
    shutdown = stage_pb2.ControllerMessage(shutdown=True)
    with control.busy(), control.hearing(PeerWait(0, 4), calls.to("busy"), calls.to("down")):
        controller.send_multipart([identity, shutdown.SerializeToString()])
        _until(lambda: calls)
    assert calls == ["down"]
    assert control.recv(0.0) == shutdown  # the main thread still sees it, if it gets there
