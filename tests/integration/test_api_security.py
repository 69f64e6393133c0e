"""TLS and bearer tokens on the gRPC and HTTP APIs, with real servers on loopback ports (no
pipeline: Generate answers UNAVAILABLE once a call is let in, which is all these checks need)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sarathi_proto import generate_pb2, generate_pb2_grpc

from controller.scheduler import ConfigError
from controller.security import read_tokens, server_credentials, token_matches
from controller.server import GenerationService, start_grpc_server

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"


def make_cert(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost (openssl CLI)."""
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def with_server(tmp_path: Path, tls: bool, check: Callable[[grpc.aio.Channel], object]) -> None:
    cert, key = make_cert(tmp_path)
    token_file = tmp_path / "tokens"
    token_file.write_text(f"# frontends\n{TOKEN}\n")

    async def main() -> None:
        creds = server_credentials(str(cert), str(key)) if tls else None
        server, port, _ = await start_grpc_server(
            GenerationService("m"), "127.0.0.1", 0, creds, read_tokens(str(token_file))
        )
        try:
            if tls:
                client_creds = grpc.ssl_channel_credentials(cert.read_bytes())
                channel = grpc.aio.secure_channel(f"localhost:{port}", client_creds)
            else:
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            async with channel:
                await check(channel)  # type: ignore[misc]
        finally:
            await server.stop(None)

    asyncio.run(main())


async def status_code(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> object:
    stub = generate_pb2_grpc.GenerationStub(channel)
    try:
        await stub.Status(generate_pb2.StatusRequest(), metadata=metadata, timeout=5)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def generate_code(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> object:
    stub = generate_pb2_grpc.GenerationStub(channel)
    try:
        async for _ in stub.Generate(
            generate_pb2.GenerateRequest(prompt="hi"), metadata=metadata, timeout=5
        ):
            pass
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_calls_without_the_right_token_are_unauthenticated_over_tls(tmp_path: Path) -> None:
    async def check(channel: grpc.aio.Channel) -> None:
        assert await status_code(channel, ()) == grpc.StatusCode.UNAUTHENTICATED
        wrong = (("authorization", "Bearer s3cret-tokeX"),)
        assert await status_code(channel, wrong) == grpc.StatusCode.UNAUTHENTICATED
        assert await generate_code(channel, wrong) == grpc.StatusCode.UNAUTHENTICATED
        right = (("authorization", f"Bearer {TOKEN}"),)
        assert await status_code(channel, right) == grpc.StatusCode.OK
        # Let in, then told the pipeline is not up: authentication passed.
        assert await generate_code(channel, right) == grpc.StatusCode.UNAVAILABLE
        # Kubernetes probes carry no token.
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(
            health_pb2.HealthCheckRequest(service="sarathi.v1.Generation"), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

    with_server(tmp_path, tls=True, check=check)


def test_a_tls_port_refuses_plaintext_clients(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)

    async def main() -> object:
        creds = server_credentials(str(cert), str(key))
        server, port, _ = await start_grpc_server(GenerationService("m"), "127.0.0.1", 0, creds)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await status_code(channel, ())
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == grpc.StatusCode.UNAVAILABLE


def test_the_http_api_speaks_https_with_the_same_certificate(tmp_path: Path) -> None:
    """--tls-cert covers the OpenAI-compatible port too: its bearer tokens never travel in
    clear, and a plaintext client gets no answer."""
    import http.client
    import ssl

    from controller.openai_api import HttpApiState, start_http_server

    cert, key = make_cert(tmp_path)

    async def main() -> tuple[int, str]:
        server = await start_http_server(
            HttpApiState("m"), "127.0.0.1", 0, tls=(str(cert), str(key))
        )

        def get(secure: bool) -> tuple[int, str]:
            if secure:
                context = ssl.create_default_context(cafile=str(cert))
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    "localhost", server.port, context=context, timeout=10
                )
            else:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                conn.request("GET", "/health")
                response = conn.getresponse()
                return response.status, response.read().decode()
            except (http.client.HTTPException, OSError) as err:
                return 0, type(err).__name__
            finally:
                conn.close()

        try:
            secure = await asyncio.to_thread(get, True)
            plain = await asyncio.to_thread(get, False)
        finally:
            await server.stop()
        assert plain[0] in (0, 400), plain  # no HTTP answer, or uvicorn's "bad request"
        return secure

    status, _ = asyncio.run(main())
    assert status == 503  # served over TLS: not ready, as no pipeline is attached


def test_token_compare_and_token_file_errors_name_the_field(tmp_path: Path) -> None:
    tokens = frozenset({"abc", "def"})
    assert token_matches("Bearer def", tokens) and token_matches("bearer abc", tokens)
    assert not token_matches("Basic abc", tokens) and not token_matches("Bearer ab", tokens)
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="auth_token_file"):
        read_tokens(str(empty))
    with pytest.raises(ConfigError, match="auth_token_file"):
        read_tokens(str(tmp_path / "missing"))


def test_sarathictl_client_speaks_tls_with_a_token(tmp_path: Path) -> None:
    from sarathictl.client import Client

    cert, key = make_cert(tmp_path)

    async def main() -> tuple[str, object]:
        creds = server_credentials(str(cert), str(key))
        server, port, _ = await start_grpc_server(
            GenerationService("tiny"), "127.0.0.1", 0, creds, frozenset({TOKEN})
        )

        def call(token: str) -> object:
            with Client(f"localhost:{port}", str(cert), token) as client:
                try:
                    return client.status().model
                except grpc.RpcError as err:
                    return err.code()

        try:
            return await asyncio.to_thread(call, TOKEN), await asyncio.to_thread(call, "nope")
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == ("tiny", grpc.StatusCode.UNAUTHENTICATED)
