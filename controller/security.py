"""Who may call the API: TLS credentials for the gRPC server and bearer-token authentication.

Tokens come from a file (a mounted Kubernetes Secret), one per line, and are compared in
constant time, so response times do not reveal how much of a guessed token was right.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from controller.scheduler import ConfigError

# Health checks stay open: Kubernetes probes and load balancers carry no token.
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def read_tokens(path: str) -> frozenset[str]:
    """Non-empty, non-comment lines of the token file; empty path: no authentication."""
    if not path:
        return frozenset()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ConfigError("auth_token_file", path, f"a readable file ({err.strerror})") from err
    tokens = frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))
    if not tokens:
        raise ConfigError("auth_token_file", path, "a file with at least one token")
    return tokens


def token_matches(authorization: str, tokens: frozenset[str]) -> bool:
    scheme, _, token = authorization.partition(" ")
    candidate = token.strip().encode()
    # Compare against every token, always: the time taken does not depend on which matched.
    matched = False
    for known in tokens:
        matched |= hmac.compare_digest(candidate, known.encode())
    return scheme.lower() == "bearer" and matched


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials | None:
    if not cert_file:
        return None
    try:
        cert, key = Path(cert_file).read_bytes(), Path(key_file).read_bytes()
    except OSError as err:
        reason = f"a readable file ({err.strerror})"
        raise ConfigError("tls_cert_file", err.filename, reason) from err
    return grpc.ssl_server_credentials([(key, cert)])


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, tokens: frozenset[str]) -> None:
        self.tokens = tokens

        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "a missing or wrong token: send metadata `authorization: Bearer <token>`",
            )

        self._refuse_unary = grpc.unary_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(refuse)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(_OPEN_METHODS):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        authorization = metadata.get("authorization", "")
        if isinstance(authorization, str) and token_matches(authorization, self.tokens):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._refuse_stream
        return self._refuse_unary
