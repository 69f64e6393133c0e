"""A small synchronous client of the controller's gRPC API, shared by the sarathictl commands."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from sarathi_proto import generate_pb2, generate_pb2_grpc

DEFAULT_ADDR = "127.0.0.1:50051"

# Round robin over every address the target resolves to: with `dns:///<headless Service>:<port>`
# (the chart's `<release>-grpc-headless`), successive calls go to successive controllers, one per
# pipeline; a plain host:port is one address, where this changes nothing. gRPC re-resolves the
# name when a connection drops, so pipelines added or gone are picked up.
CHANNEL_OPTIONS = (
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
)

FINISH_NAMES = {
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class RetryPolicy:
    """How `Client.generate_resumable` retries a stream cut by UNAVAILABLE."""

    max_retries: int = 8
    """Retries in a row without a token received in between."""
    max_retries_unanswered: int = 2
    """Retries while no connection could be made and nothing has answered (connection refused,
    nothing listening): most often no cluster is up, which the user should hear in about a
    second, not after the whole backoff. A controller that refused the call (not ready, a
    standby taking over) or a stream cut after its first answer gets max_retries."""
    first_backoff_s: float = 0.25
    max_backoff_s: float = 4.0

    def backoff_s(self, retry_number: int) -> float:
        """Wait before retry number n (1-based): doubling from first_backoff_s, capped."""
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (retry_number - 1))


_NO_CONNECTION = ("failed to connect", "connections to all backends failing", "dns resolution")
"""What gRPC's own UNAVAILABLE says when no connection could be made (versions word it
differently); a controller's UNAVAILABLE (not ready, shutting down, a stage down) says none."""


def nobody_listens(err: grpc.RpcError) -> bool:
    """True when the call found no controller at all, rather than one that refused it."""
    details = (err.details() or "").lower()
    return any(marker in details for marker in _NO_CONNECTION)


def _copy(request: generate_pb2.GenerateRequest) -> generate_pb2.GenerateRequest:
    copy = generate_pb2.GenerateRequest()
    copy.CopyFrom(request)
    return copy


class Client:
    def __init__(self, addr: str = DEFAULT_ADDR, tls_ca_file: str = "", token: str = "") -> None:
        """tls_ca_file: PEM of the CA that signed the controller's certificate (TLS on);
        token: sent as `authorization: Bearer <token>` on every call."""
        self.addr = addr
        if tls_ca_file:
            with open(tls_ca_file, "rb") as f:
                credentials = grpc.ssl_channel_credentials(f.read())
            self._channel = grpc.secure_channel(addr, credentials, CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(addr, CHANNEL_OPTIONS)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)

    def generate(
        self, request: generate_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> Iterator[generate_pb2.GenerateResponse]:
        yield from self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)

    def generate_resumable(
        self,
        request: generate_pb2.GenerateRequest,
        timeout_s: float | None = None,
        retry: RetryPolicy | None = None,
        on_retry: Callable[[int, int, int, grpc.RpcError], None] | None = None,
    ) -> Iterator[generate_pb2.GenerateResponse]:
        """Streams like `generate`, and when the stream breaks with UNAVAILABLE (the controller
        died or is failing over, the connection dropped, the pipeline is rebuilding) calls again
        with the token ids received so far (`resume_token_ids`) and the seed the first message
        named, so the stream goes on where it was cut: same tokens, none repeated or missing.
        Retries back off exponentially and are counted from the last token received; past
        `retry.max_retries` (`retry.max_retries_unanswered` while nobody listens) the error is
        raised. on_retry(retry_number, limit, tokens_received, error) is called
        before each retry. timeout_s bounds the whole stream, retries included."""
        retry = retry or RetryPolicy()
        request = _copy(request)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        received = list(request.resume_token_ids)
        failures = 0
        answered = False
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            first = True
            try:
                for response in self.generate(request, timeout_s=remaining):
                    answered = True
                    if first and not request.sampling.HasField("seed"):
                        request.sampling.seed = response.seed  # the server's draw: keep it
                    first = False
                    if response.token_ids:
                        received.extend(response.token_ids)
                        failures = 0
                    yield response
                return
            except grpc.RpcError as err:
                limit = retry.max_retries
                if not answered and nobody_listens(err):
                    limit = min(limit, retry.max_retries_unanswered)
                if err.code() != grpc.StatusCode.UNAVAILABLE or failures >= limit:
                    raise
                failures += 1
                if on_retry is not None:
                    on_retry(failures, limit, len(received), err)
                time.sleep(retry.backoff_s(failures))
                del request.resume_token_ids[:]
                request.resume_token_ids.extend(received)

    def status(self, timeout_s: float = 5.0) -> generate_pb2.StatusResponse:
        response: generate_pb2.StatusResponse = self._stub.Status(
            generate_pb2.StatusRequest(), timeout=timeout_s, metadata=self._metadata
        )
        return response

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """--addr plus what a secured controller needs: its CA and a bearer token."""
    p.add_argument(
        "--addr",
        default=DEFAULT_ADDR,
        help=f"controller host:port (default {DEFAULT_ADDR}), or dns:///NAME:PORT to spread calls "
        "over every address NAME resolves to (a headless Service over several pipelines)",
    )
    p.add_argument("--tls-ca", default="", help="PEM CA of the controller's certificate (TLS)")
    p.add_argument(
        "--token-file", default="", help="file whose first line is the bearer token to send"
    )


def client_from_args(args: argparse.Namespace) -> Client:
    token = ""
    if args.token_file:
        with open(args.token_file) as f:
            token = f.readline().strip()
    return Client(args.addr, args.tls_ca, token)


def explain_rpc_error(err: grpc.RpcError, addr: str) -> str:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach a controller at {addr} ({details}); is `sarathictl up` running?"
    return f"{code.name if code else 'error'}: {details}"
