"""uvicorn inside the controller's event loop, on a socket we bind ourselves (port 0 works)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator

import uvicorn

from controller.bind_error import BindError
from controller.openai_api.routes import build_app
from controller.openai_api.state import HttpApiState
from controller.task_watch import start_watched

log = logging.getLogger(__name__)

# Streams still open at shutdown get this long to end before their tasks are cancelled.
_GRACEFUL_SHUTDOWN_S = 1
# An idle keep-alive connection stays open this long (uvicorn's default is 5 s). A pooling client
# that holds connections longer (aiohttp, as `vllm bench serve` sets it up: 60 s) would
# otherwise reuse one the server has closed and get a reset: one request of a few hundred did in
# session 16's benchmark, on a connection idle for 7 s (BENCHMARKS). 75 s, as nginx keeps them.
_KEEP_ALIVE_S = 75


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The controller owns SIGINT/SIGTERM (controller/app.py) and stops this server itself;
        # uvicorn's own handlers would replace the controller's.
        yield


class HttpApiServer:
    def __init__(
        self, state: HttpApiState, host: str, port: int, tls: tuple[str, str] | None = None
    ) -> None:
        """tls: (certificate chain, private key) PEM files: the port then speaks only HTTPS,
        as the gRPC port does with the same pair (bearer tokens are not sent in clear)."""
        self.state = state
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as err:
            self._socket.close()
            raise BindError(f"cannot bind the HTTP API to {host}:{port}: {err}") from err
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            build_app(state),
            lifespan="off",
            log_config=None,  # keep the controller's logging set-up as it is
            access_log=False,
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
            timeout_keep_alive=_KEEP_ALIVE_S,
            ssl_certfile=tls[0] if tls else None,
            ssl_keyfile=tls[1] if tls else None,
        )
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self, on_task_failed: Callable[[str], None] = lambda name: None) -> None:
        """on_task_failed: called if the server's task raises once serving (task_watch.py)."""
        self._task = start_watched(self._server.serve([self._socket]), "http-api", on_task_failed)
        while not self._server.started:
            if self._task.done():  # start-up failed: surface its exception
                await self._task
                raise OSError(f"the HTTP API on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.state.detach()
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        # A task that raised was logged when it did; stopping goes on.
        await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close()


async def start_http_server(
    state: HttpApiState,
    host: str,
    port: int,
    on_task_failed: Callable[[str], None] = lambda name: None,
    tls: tuple[str, str] | None = None,
) -> HttpApiServer:
    """Listening when this returns; requests get 503 until `state.attach`."""
    server = HttpApiServer(state, host, port, tls)
    await server.start(on_task_failed)
    return server
