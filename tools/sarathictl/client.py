"""A small synchronous client of the controller's gRPC API, shared by the sarathictl commands."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from sarathi_proto import generate_pb2, generate_pb2_grpc

DEFAULT_ADDR = "127.0.0.1:50051"

FINISH_NAMES = {
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


class Client:
    def __init__(self, addr: str = DEFAULT_ADDR) -> None:
        self.addr = addr
        self._channel = grpc.insecure_channel(addr)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)

    def generate(
        self, request: generate_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> Iterator[generate_pb2.GenerateResponse]:
        yield from self._stub.Generate(request, timeout=timeout_s)

    def status(self, timeout_s: float = 5.0) -> generate_pb2.StatusResponse:
        response: generate_pb2.StatusResponse = self._stub.Status(
            generate_pb2.StatusRequest(), timeout=timeout_s
        )
        return response

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def explain_rpc_error(err: grpc.RpcError, addr: str) -> str:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach a controller at {addr} ({details}); is `sarathictl up` running?"
    return f"{code.name if code else 'error'}: {details}"
