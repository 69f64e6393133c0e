"""The controller's end of the ZeroMQ control plane: one ROUTER socket, one protobuf per frame."""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio
from sarathi_proto import stage_pb2

from controller.executor.curve import CurveServerKeys, secure_router
from controller.step_phases import clock

log = logging.getLogger(__name__)


class ControlChannel:
    """Workers connect a DEALER each; the ROUTER knows them by their socket identity.

    Frames are serialized stage_pb2 messages (never pickle). ROUTER_MANDATORY makes a send to a
    worker that went away fail loudly instead of vanishing.
    """

    def __init__(
        self, ctx: zmq.asyncio.Context, bind_addr: str, curve: CurveServerKeys | None = None
    ) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Security options must be set before bind.
        self._auth = secure_router(ctx, self._sock, curve) if curve is not None else None
        if bind_addr.startswith("tcp://") and bind_addr.rsplit(":", 1)[1] == "0":
            host = bind_addr[len("tcp://") :].rsplit(":", 1)[0]
            port = self._sock.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
        else:
            self._sock.bind(bind_addr)
            self.address = bind_addr
        self.received_at = 0.0
        log.info("control plane listening on %s", self.address)

    async def recv(self) -> tuple[bytes, stage_pb2.WorkerMessage]:
        """The next message; `received_at` is when it came off the socket, before parsing."""
        identity, payload = await self._sock.recv_multipart()
        self.received_at = clock()
        msg = stage_pb2.WorkerMessage()
        msg.ParseFromString(payload)
        return identity, msg

    async def send(self, identity: bytes, msg: stage_pb2.ControllerMessage) -> None:
        await self.send_bytes(identity, msg.SerializeToString())

    async def send_bytes(self, identity: bytes, payload: bytes) -> None:
        """Sends an already serialized ControllerMessage (one plan goes to many workers)."""
        await self._sock.send_multipart([identity, payload])

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
