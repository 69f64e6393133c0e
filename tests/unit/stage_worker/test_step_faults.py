"""A step that raises on a worker: which exceptions are the step's own (reported to the
controller as a StepFault, to quarantine its requests) and which are a broken link, and the
report leaving before the process exits."""

from __future__ import annotations

import time

import pytest
import torch
import zmq
from sarathi_proto import stage_pb2

from stage_worker import worker
from stage_worker.control_socket import ControlSocket
from stage_worker.errors import PlanError, StepFaulted
from stage_worker.worker import device_faults, step_faults


@pytest.mark.parametrize(
    "error", [RuntimeError("index out of range"), ValueError("bad"), RuntimeError("CUDA error")]
)
def test_the_steps_own_errors_name_the_micro_batch(error: Exception) -> None:
    with pytest.raises(StepFaulted) as fault, step_faults(12):
        raise error
    assert fault.value.batch_id == 12 and fault.value.cause is error
    assert f"micro-batch 12: {type(error).__name__}" in str(fault.value)


@pytest.mark.parametrize(
    "error",
    [
        PlanError("unknown sequence 7"),  # answered with a result that says `rejected`
        zmq.ZMQError(zmq.EHOSTUNREACH),  # the controller is gone
        torch.distributed.DistBackendError("Connection closed by peer"),  # a peer is gone
    ],
)
def test_a_refused_plan_and_a_broken_link_pass_as_they_are(error: Exception) -> None:
    with pytest.raises(type(error)), step_faults(12):
        raise error


def device_error() -> Exception:
    """A kernel's error as this torch raises it (AcceleratorError from torch 2.8 on)."""
    message = "CUDA error: device-side assert triggered"
    return getattr(torch, "AcceleratorError", RuntimeError)(message)


def test_around_a_link_only_a_device_error_is_the_steps() -> None:
    with pytest.raises(StepFaulted), device_faults(3):
        raise device_error()
    with pytest.raises(RuntimeError, match="Connection closed by peer"), device_faults(3):
        raise RuntimeError("Connection closed by peer")  # gloo's: the link


def test_before_torch_2_8_a_device_error_is_told_by_its_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker, "_ACCELERATOR_ERROR", RuntimeError)
    assert worker.is_device_error(RuntimeError("CUDA error: an illegal memory access"))
    assert not worker.is_device_error(RuntimeError("Connection closed by peer"))


def test_the_last_message_leaves_before_send_last_returns() -> None:
    ctx = zmq.Context()  # of its own: send_last ends the context, as the worker exits next
    controller = zmq.Context().socket(zmq.ROUTER)
    port = controller.bind_to_random_port("tcp://127.0.0.1")
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    control = ControlSocket(sock)
    fault = stage_pb2.StepFault(batch_id=9, stage=1, tp_rank=0, error="RuntimeError: boom")
    control.send_last(stage_pb2.WorkerMessage(fault=fault), linger_s=5.0)
    assert ctx.closed
    assert controller.poll(5000)
    _, payload = controller.recv_multipart()
    assert stage_pb2.WorkerMessage.FromString(payload).fault == fault
    controller.close(linger=0)


def test_with_nobody_listening_send_last_gives_up_after_the_linger() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect("tcp://127.0.0.1:9")  # nothing listens there
    start = time.monotonic()
    ControlSocket(sock).send_last(stage_pb2.WorkerMessage(alive=True), linger_s=0.3)
    assert time.monotonic() - start < 5.0 and ctx.closed
