"""`sarathictl up --local` on a tiny model as a test fixture: started, waited on until healthy,
reached over gRPC, stopped with SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sarathi_proto import generate_pb2, generate_pb2_grpc


@dataclass
class RunningCluster:
    proc: subprocess.Popen[bytes]
    addr: str
    model_dir: Path
    channel: grpc.Channel
    log_dir: Path

    @property
    def stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(self.channel)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def local_cluster(
    model_dir: Path, log_dir: Path, up_args: list[str], ready_s: float = 240
) -> Iterator[RunningCluster]:
    """`sarathictl up --local` with up_args on model_dir, once its Generation service is
    serving; SIGTERM after."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "sarathictl.cli", "up", "--local", *up_args,
            "--model", str(model_dir), "--port", str(port), "--log-dir", str(log_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    addr = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(addr)
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + ready_s
    request = health_pb2.HealthCheckRequest(service="sarathi.v1.Generation")
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"sarathictl up exited early:\n{proc.stdout.read().decode()}")  # type: ignore[union-attr]
        try:
            if health.Check(request, timeout=1).status == 1:
                break
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, "cluster did not become healthy"
        time.sleep(0.5)
    try:
        yield RunningCluster(proc, addr, model_dir, channel, log_dir)
    finally:
        channel.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def generate(cluster: RunningCluster, **fields: object) -> list[generate_pb2.GenerateResponse]:
    return list(cluster.stub.Generate(generate_pb2.GenerateRequest(**fields), timeout=120))
