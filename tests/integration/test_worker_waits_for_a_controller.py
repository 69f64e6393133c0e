"""A stage worker waiting for its place's assignment, with a controller played by the test:
one that has answered and then goes silent (it died; a restarted one at the same address never
heard this worker's hello) is left after --controller-timeout, so the supervisor restarts the
worker and it says hello again; one that has not answered yet (not up yet) is waited for."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from sarathi_proto import stage_pb2

from tests.integration.cluster_factories import make_tiny_served_model

pytestmark = pytest.mark.integration

TIMEOUT_S = 2.0


@pytest.fixture
def controller() -> Iterator[tuple[zmq.Socket, str]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(linger=0)
        ctx.term()


def start_worker(model_dir: Path, address: str, log: Path) -> subprocess.Popen[bytes]:
    args = [
        sys.executable, "-m", "stage_worker", "--controller", address, "--model", str(model_dir),
        "--stage", "0", "--dtype", "float32", "--num-threads", "1",
        "--kv-cache-bytes", str(4 << 20), "--controller-timeout", str(TIMEOUT_S),
    ]  # fmt: skip
    return subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def hello_of(sock: zmq.Socket) -> bytes:
    assert sock.poll(60_000), "no hello"
    identity, payload = sock.recv_multipart()
    assert stage_pb2.WorkerMessage.FromString(payload).WhichOneof("body") == "hello"
    return bytes(identity)


def test_a_controller_that_answered_then_fell_silent_is_left(
    controller: tuple[zmq.Socket, str], tmp_path: Path
) -> None:
    sock, address = controller
    model_dir = make_tiny_served_model(tmp_path / "tiny")
    log = tmp_path / "worker.log"
    worker = start_worker(model_dir, address, log)
    try:
        identity = hello_of(sock)
        ping = stage_pb2.ControllerMessage(ping=stage_pb2.Ping(last_batch_ids=[0]))
        sock.send_multipart([identity, ping.SerializeToString()])  # it holds a place: pings
        silent_since = time.monotonic()
        code = worker.wait(timeout=30)
        waited_s = time.monotonic() - silent_since
    finally:
        worker.kill()
    text = log.read_text(errors="replace")
    assert code != 0 and "while waiting for an assignment" in text, text
    assert TIMEOUT_S <= waited_s < TIMEOUT_S + 10


def test_a_controller_not_heard_yet_is_waited_for(
    controller: tuple[zmq.Socket, str], tmp_path: Path
) -> None:
    sock, address = controller
    model_dir = make_tiny_served_model(tmp_path / "tiny")
    worker = start_worker(model_dir, address, tmp_path / "worker.log")
    try:
        hello_of(sock)
        time.sleep(3 * TIMEOUT_S)
        assert worker.poll() is None  # still waiting for its assignment
    finally:
        worker.kill()
        worker.wait()
