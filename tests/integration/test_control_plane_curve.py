"""CurveZMQ on the control plane: a worker with a listed key talks to the controller's ROUTER;
one with an unknown key, or without CURVE, never gets a message through."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
import zmq.auth
from sarathi_proto import stage_pb2

from controller.executor.control_channel import ControlChannel
from controller.executor.curve import CurveServerKeys
from controller.scheduler import ConfigError

pytestmark = pytest.mark.integration


def make_keys(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(server secret cert, allowed clients' public dir, a stranger's secret cert)."""
    server_dir, clients, strangers = tmp_path / "server", tmp_path / "clients", tmp_path / "x"
    for folder in (server_dir, clients, strangers):
        folder.mkdir()
    zmq.auth.create_certificates(str(server_dir), "controller")
    _, worker_secret = zmq.auth.create_certificates(str(clients), "worker")
    _, stranger_secret = zmq.auth.create_certificates(str(strangers), "stranger")
    (tmp_path / "worker.key_secret").write_text(Path(worker_secret).read_text())
    Path(worker_secret).unlink()  # the folder holds public keys only
    return server_dir / "controller.key_secret", clients, Path(stranger_secret)


def hello_arrives(
    server_secret: Path, clients: Path, client_cert: Path | None, wait_s: float
) -> bool:
    """Whether a WorkerHello sent with client_cert (None: plain TCP) reaches the controller
    within wait_s."""

    async def main() -> bool:
        ctx = zmq.asyncio.Context()
        channel = ControlChannel(
            ctx, "tcp://127.0.0.1:0", CurveServerKeys(str(server_secret), str(clients))
        )
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if client_cert is not None:
            server_public, _ = zmq.auth.load_certificate(str(server_secret))
            public, secret = zmq.auth.load_certificate(str(client_cert))
            dealer.curve_serverkey, dealer.curve_publickey = server_public, public
            dealer.curve_secretkey = secret
        dealer.connect(channel.address)
        hello = stage_pb2.WorkerMessage(hello=stage_pb2.WorkerHello(worker_id="w"))
        await dealer.send(hello.SerializeToString())
        try:
            _, msg = await asyncio.wait_for(channel.recv(), wait_s)
            return msg.hello.worker_id == "w"
        except TimeoutError:
            return False
        finally:
            dealer.close()
            channel.close()
            ctx.term()

    return asyncio.run(main())


def test_only_workers_with_listed_keys_reach_the_controller(tmp_path: Path) -> None:
    server_secret, clients, stranger = make_keys(tmp_path)
    # a handshake a loaded machine completes in time; refusals are waited out for 2 s
    assert hello_arrives(server_secret, clients, tmp_path / "worker.key_secret", wait_s=15)
    assert not hello_arrives(server_secret, clients, stranger, wait_s=2)
    assert not hello_arrives(server_secret, clients, None, wait_s=2)  # plain TCP


def test_missing_key_files_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="curve_secret_key_file"):
        CurveServerKeys(str(tmp_path / "missing"), str(tmp_path))
