"""Cluster mode: the controller's side of etcd membership, and the election of the active one.

The key `controller` names the active controller (where its control plane and API listen). It is
written only if absent (a transaction on its create revision) and lives under the writer's lease,
so it is also the leader lock: one controller holds it, any other is a standby that waits for the
key to go (its holder's lease expired: the process died or lost etcd) and then takes it. Workers
find the controller there and leave when it changes (stage_worker/etcd_registration.py). The
active controller also watches `workers/` to log who joins and who loses its lease. The pipeline
itself is still assembled over ZeroMQ (hello -> assignment).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aetcd
from sarathi_proto import stage_pb2

from controller.task_watch import start_watched

log = logging.getLogger(__name__)

LEASE_TTL_S = 3
"""Seconds the `controller` key outlives a dead controller: how long a standby waits."""


def cluster_prefix(cluster: str) -> bytes:
    return f"/sarathi/{cluster}/".encode()


def parse_endpoint(addr: str) -> tuple[str, int]:
    """HOST:PORT of an etcd client endpoint (an http:// prefix is accepted)."""
    addr = addr.removeprefix("http://")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd={addr!r} is invalid: HOST:PORT")
    return host, int(port)


class LeadershipLost(ConnectionError):
    """The leader lease ended while this controller was active: another may have taken over."""


class ControllerMembership:
    def __init__(self, etcd_addr: str, cluster: str, lease_ttl_s: int = LEASE_TTL_S) -> None:
        self.host, self.port = parse_endpoint(etcd_addr)
        self.cluster = cluster
        self.prefix = cluster_prefix(cluster)
        self.lease_ttl_s = lease_ttl_s
        self.workers: dict[str, stage_pb2.WorkerRegistration] = {}
        self._client: aetcd.Client | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.on_worker_lost: Callable[[str], None] | None = None
        self.on_leadership_lost: Callable[[], None] | None = None
        """Called once if the leader lease ends while active (the controller must stop)."""
        self.on_task_failed: Callable[[str], None] = lambda name: None
        """Called with the name of the lease or watch task if it raised (task_watch.py)."""
        self.is_leader = False

    @property
    def key(self) -> bytes:
        return self.prefix + b"controller"

    async def connect(self, timeout_s: float = 10.0) -> None:
        """Raises ConnectionError naming the address when etcd cannot be reached."""
        client = aetcd.Client(host=self.host, port=self.port, timeout=timeout_s)
        try:
            await asyncio.wait_for(client.connect(), timeout_s)
            await asyncio.wait_for(client.get(self.key), timeout_s)  # reachable, not just dialled
        except (TimeoutError, aetcd.exceptions.ClientError, OSError) as err:
            await client.close()
            raise ConnectionError(
                f"cannot reach etcd at {self.host}:{self.port}: {err or type(err).__name__}"
            ) from err
        self._client = client

    async def lead(
        self,
        endpoint: stage_pb2.ControllerEndpoint,
        on_standby: Callable[[stage_pb2.ControllerEndpoint], None],
    ) -> None:
        """Returns once this controller is the active one: at once when no controller holds the
        key, else after its holder's lease ends. on_standby(holder) is called each time another
        controller is found active. Then keeps the lease alive and watches the workers."""
        client = self._client
        assert client is not None, "connect() first"
        while True:
            lease = await client.lease(self.lease_ttl_s)
            won, _ = await client.transaction(
                compare=[client.transactions.create(self.key) == 0],
                success=[client.transactions.put(self.key, endpoint.SerializeToString(), lease)],
                failure=[],
            )
            if won:
                break
            await lease.revoke()
            await self._wait_while_held(client, on_standby)
        self.is_leader = True
        log.info(
            "active controller of cluster %r (etcd %s:%d, leader lease %d s)",
            self.cluster, self.host, self.port, self.lease_ttl_s,
        )  # fmt: skip
        for kv in await client.get_prefix(self.prefix + b"workers/"):
            self._on_put(kv.value)
        self._tasks = [
            start_watched(self._keep_alive(lease), "etcd-keepalive", self._task_failed),
            start_watched(self._watch(), "etcd-watch", self._task_failed),
        ]

    def _task_failed(self, name: str) -> None:
        self.on_task_failed(name)  # looked up now: set after the tasks started

    async def _wait_while_held(
        self,
        client: aetcd.Client,
        on_standby: Callable[[stage_pb2.ControllerEndpoint], None],
    ) -> None:
        """Standby: returns when the key is gone (watched from the revision it was read at, so
        a delete in between is not missed)."""
        found = await client.get(self.key)
        if found is None:
            return
        holder = stage_pb2.ControllerEndpoint()
        holder.ParseFromString(found.value)
        on_standby(holder)
        log.info("standby: the active controller is %s; waiting for its lease", holder.grpc_addr)
        events = await client.watch(self.key, start_revision=found.mod_revision + 1)
        async for event in events:
            if event.kind == aetcd.EventKind.DELETE:
                log.info("the active controller's lease ended: taking over")
                await events.cancel()
                return

    async def _keep_alive(self, lease: aetcd.Lease) -> None:
        """Refreshes the leader lease three times a TTL; once etcd says it expired (or no
        refresh got through for a whole TTL), this controller is no longer the active one."""
        last_ok = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            try:
                reply = await lease.refresh()
                alive = reply is not None and reply.TTL > 0
                if alive:
                    last_ok = asyncio.get_running_loop().time()
            except aetcd.exceptions.ClientError as err:
                log.error("etcd lease refresh failed: %s", err)
                alive = asyncio.get_running_loop().time() - last_ok < self.lease_ttl_s
            if not alive:
                log.error("the leader lease in etcd ended: this controller is no longer active")
                self.is_leader = False
                if self.on_leadership_lost is not None:
                    self.on_leadership_lost()
                return

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
        """Stops; an active controller deletes its key, so a standby takes over at once."""
        for task in self._tasks:
            task.cancel()
        if self._client is not None:
            if self.is_leader:
                with contextlib.suppress(Exception):
                    await self._client.delete(self.key)
            await self._client.close()
