"""Cluster mode: the controller's side of etcd membership.

The controller publishes where its control plane listens (key `controller`, under its lease) so
that workers can find it, and watches `workers/` to log who joins and who loses its lease. The
pipeline itself is still assembled over ZeroMQ (hello -> assignment); etcd answers "who is
alive" and "where is the controller", which is what a Kubernetes pod needs at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aetcd
from sarathi_proto import stage_pb2

log = logging.getLogger(__name__)

LEASE_TTL_S = 10


def cluster_prefix(cluster: str) -> bytes:
    return f"/sarathi/{cluster}/".encode()


def parse_endpoint(addr: str) -> tuple[str, int]:
    """HOST:PORT of an etcd client endpoint (an http:// prefix is accepted)."""
    addr = addr.removeprefix("http://")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd={addr!r} is invalid: HOST:PORT")
    return host, int(port)


class ControllerMembership:
    def __init__(self, etcd_addr: str, cluster: str) -> None:
        self.host, self.port = parse_endpoint(etcd_addr)
        self.cluster = cluster
        self.prefix = cluster_prefix(cluster)
        self.workers: dict[str, stage_pb2.WorkerRegistration] = {}
        self._client: aetcd.Client | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.on_worker_lost: Callable[[str], None] | None = None

    async def start(self, endpoint: stage_pb2.ControllerEndpoint, timeout_s: float = 10.0) -> None:
        """Connects, publishes the endpoint under a lease, starts keep-alive and the watch.
        Raises ConnectionError naming the address when etcd cannot be reached."""
        client = aetcd.Client(host=self.host, port=self.port, timeout=timeout_s)
        try:
            await asyncio.wait_for(client.connect(), timeout_s)
            lease = await asyncio.wait_for(client.lease(LEASE_TTL_S), timeout_s)
            key = self.prefix + b"controller"
            await client.put(key, endpoint.SerializeToString(), lease=lease)
        except (TimeoutError, aetcd.exceptions.ClientError, OSError) as err:
            await client.close()
            raise ConnectionError(
                f"cannot reach etcd at {self.host}:{self.port}: {err or type(err).__name__}"
            ) from err
        self._client = client
        log.info(
            "published the controller of cluster %r in etcd %s:%d",
            self.cluster,
            self.host,
            self.port,
        )
        for kv in await client.get_prefix(self.prefix + b"workers/"):
            self._on_put(kv.value)
        self._tasks = [
            asyncio.create_task(self._keep_alive(lease), name="etcd-keepalive"),
            asyncio.create_task(self._watch(), name="etcd-watch"),
        ]

    async def _keep_alive(self, lease: aetcd.Lease) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            try:
                await lease.refresh()
            except aetcd.exceptions.ClientError as err:
                log.error("etcd lease refresh failed: %s", err)

    async def _watch(self) -> None:
        assert self._client is not None
        events = await self._client.watch_prefix(self.prefix + b"workers/")
        async for event in events:
            if event.kind == aetcd.EventKind.PUT:
                self._on_put(event.kv.value)
            else:
                worker_id = event.kv.key.rsplit(b"/", 1)[-1].decode()
                self.workers.pop(worker_id, None)
                log.warning("worker %s lost its etcd lease", worker_id)
                if self.on_worker_lost is not None:
                    self.on_worker_lost(worker_id)

    def _on_put(self, value: bytes) -> None:
        reg = stage_pb2.WorkerRegistration()
        reg.ParseFromString(value)
        if reg.worker_id not in self.workers:
            log.info(
                "worker %s registered from %s (%d GPUs)", reg.worker_id, reg.host, reg.num_gpus
            )
        self.workers[reg.worker_id] = reg

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.delete(self.prefix + b"controller")
            await self._client.close()
