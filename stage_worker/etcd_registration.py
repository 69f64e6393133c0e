"""Cluster mode: the worker's side of etcd membership.

The worker registers under a lease (key `workers/<worker_id>`, a WorkerRegistration) and keeps
the lease alive from a background thread, so the registration vanishes when the process dies;
it learns where the controller's control plane listens from the `controller` key, waiting for
the controller if it is not up yet. The rest of start-up is the ZeroMQ handshake.

The worker then follows that key: when it goes (the active controller died and its lease
ended) or names another controller (a standby took over), `on_controller_changed` is called, and
`next_controller` hands the worker the new controller's address once one is there, so the
worker joins it at once instead of waiting out its controller timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

import aetcd
from sarathi_proto import stage_pb2

logger = logging.getLogger(__name__)

LEASE_TTL_S = 10


def parse_etcd_endpoint(addr: str) -> tuple[str, int]:
    addr = addr.removeprefix("http://")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd={addr!r}: must be HOST:PORT")
    return host, int(port)


class EtcdRegistration:
    def __init__(self, etcd_addr: str, cluster: str, registration: stage_pb2.WorkerRegistration):
        self.host, self.port = parse_etcd_endpoint(etcd_addr)
        self.prefix = f"/sarathi/{cluster}/".encode()
        self.registration = registration
        self._endpoint: stage_pb2.ControllerEndpoint | None = None
        self._error: BaseException | None = None
        self._found = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="etcd-registration", daemon=True)
        self.on_controller_changed: Callable[[str], None] | None = None
        """Called (on this object's thread) each time the controller is gone or replaced, with
        what happened."""
        self._changed = threading.Condition()
        self._generation = 0
        """Controllers seen since start: 1 once the first is found, +1 per successor."""
        self._taken = 1
        """The generation the worker last took an address of."""

    def start(self, timeout_s: float) -> stage_pb2.ControllerEndpoint:
        """Registers and returns the controller's endpoint; raises ConnectionError when etcd is
        unreachable, TimeoutError when no controller appears within timeout_s."""
        self._thread.start()
        if not self._found.wait(timeout_s):
            raise TimeoutError(
                f"no controller registered in etcd {self.host}:{self.port} under "
                f"{self.prefix.decode()} within {timeout_s:.0f} s"
            )
        if self._error is not None:
            raise ConnectionError(
                f"cannot reach etcd at {self.host}:{self.port}: {self._error}"
            ) from self._error
        assert self._endpoint is not None
        return self._endpoint

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as err:  # reported through start()
            self._error = err
            self._found.set()
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with aetcd.Client(host=self.host, port=self.port, timeout=10) as client:
            lease = await client.lease(LEASE_TTL_S)
            key = self.prefix + b"workers/" + self.registration.worker_id.encode()
            await client.put(key, self.registration.SerializeToString(), lease=lease)
            logger.info("registered in etcd %s:%d as %s", self.host, self.port, key.decode())
            keep_alive = asyncio.create_task(self._keep_alive(lease))
            revision = await self._await_controller(client)
            follow = asyncio.create_task(self._follow_controller(client, revision))
            await self._stop.wait()
            follow.cancel()
            keep_alive.cancel()
            with contextlib.suppress(Exception):
                await lease.revoke()

    async def _await_controller(self, client: aetcd.Client) -> int:
        """Finds the controller's endpoint; returns the revision it was written at."""
        key = self.prefix + b"controller"
        found = await client.get(key)
        if found is None:
            logger.info("waiting for a controller to register in etcd")
            events = await client.watch(key)
            async for event in events:
                if event.kind == aetcd.EventKind.PUT:
                    found = event.kv
                    break
        assert found is not None
        endpoint = stage_pb2.ControllerEndpoint()
        endpoint.ParseFromString(found.value)
        with self._changed:
            self._endpoint = endpoint
            self._generation = 1
        self._found.set()
        return int(found.mod_revision)

    async def _follow_controller(self, client: aetcd.Client, revision: int) -> None:
        """Every change of the key after `revision`: a delete means the controller is gone, a
        put names its successor."""
        events = await client.watch(self.prefix + b"controller", start_revision=revision + 1)
        async for event in events:
            if event.kind == aetcd.EventKind.DELETE:
                self._tell("its lease ended")
                continue
            endpoint = stage_pb2.ControllerEndpoint()
            endpoint.ParseFromString(event.kv.value)
            # Told first, then handed out: a worker that takes the new address has been told.
            self._tell(f"the controller at {endpoint.control_addr} took over")
            with self._changed:
                self._endpoint = endpoint
                self._generation += 1
                self._changed.notify_all()

    def _tell(self, what: str) -> None:
        logger.warning("the controller registered in etcd changed: %s", what)
        if self.on_controller_changed is not None:
            self.on_controller_changed(what)

    def next_controller(self, timeout_s: float) -> str:
        """The control address of the controller that took over since the last call (the first
        call: since start); waits for it up to timeout_s, then raises TimeoutError."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._generation > self._taken, timeout_s):
                raise TimeoutError(f"no new controller registered in etcd within {timeout_s:.0f} s")
            self._taken = self._generation
            assert self._endpoint is not None
            return self._endpoint.control_addr

    async def _keep_alive(self, lease: aetcd.Lease) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            try:
                await lease.refresh()
            except aetcd.exceptions.ClientError as err:
                logger.error("etcd lease refresh failed: %s", err)

    def close(self) -> None:
        """Revokes the lease (the registration disappears at once) and stops the thread."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=5)
