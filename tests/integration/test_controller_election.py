"""The active-controller election (controller/cluster_membership.py) against a real etcd: one
controller holds the `controller` key, a second waits as a standby and takes over once the first
stops or dies (its lease expires), and a worker following the key hears of each change."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sarathi_proto import stage_pb2

from controller.cluster_membership import ControllerMembership
from stage_worker.etcd_registration import EtcdRegistration

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd server"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [
            "etcd", "--data-dir", str(tmp_path / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{client}",
            "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", client)) == 0:
                    break
            assert time.monotonic() < deadline, "etcd did not start"
            time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def endpoint(name: str) -> stage_pb2.ControllerEndpoint:
    return stage_pb2.ControllerEndpoint(control_addr=f"tcp://{name}:5555", grpc_addr=name)


def test_one_leads_the_other_waits_and_takes_over_when_it_stops(etcd: str) -> None:
    async def main() -> list[str]:
        events: list[str] = []
        first = ControllerMembership(etcd, "t", lease_ttl_s=2)
        second = ControllerMembership(etcd, "t", lease_ttl_s=2)
        await first.connect()
        await second.connect()
        await first.lead(endpoint("a"), lambda held: events.append(f"standby of {held.grpc_addr}"))
        events.append("a leads")
        waiting = asyncio.create_task(
            second.lead(endpoint("b"), lambda held: events.append(f"b waits for {held.grpc_addr}"))
        )
        await asyncio.sleep(1.0)
        assert not waiting.done() and not second.is_leader
        await first.close()  # a clean stop deletes the key: the standby takes over at once
        await asyncio.wait_for(waiting, 5)
        events.append("b leads")
        await second.close()
        return events

    assert asyncio.run(main()) == ["a leads", "b waits for a", "b leads"]


def test_a_dead_leader_is_replaced_after_its_lease_and_workers_hear_of_it(etcd: str) -> None:
    changes: list[str] = []
    heard = threading.Event()
    worker = EtcdRegistration(
        etcd, "t", stage_pb2.WorkerRegistration(worker_id="w", host="h", model="m")
    )

    def on_change(what: str) -> None:
        changes.append(what)
        heard.set()

    worker.on_controller_changed = on_change

    async def main() -> float:
        dead = ControllerMembership(etcd, "t", lease_ttl_s=2)
        await dead.connect()
        await dead.lead(endpoint("a"), lambda held: None)
        found = await asyncio.to_thread(worker.start, 10)
        assert found.grpc_addr == "a"
        # kill -9: the keep-alive stops and nothing deletes the key; the lease must expire.
        for task in dead._tasks:
            task.cancel()
        died_at = time.monotonic()
        standby = ControllerMembership(etcd, "t", lease_ttl_s=2)
        await standby.connect()
        await asyncio.wait_for(standby.lead(endpoint("b"), lambda held: None), 10)
        took_over_s = time.monotonic() - died_at
        # The worker is handed the successor's control address.
        assert await asyncio.to_thread(worker.next_controller, 5) == "tcp://b:5555"
        await standby.close()
        return took_over_s

    try:
        took_over_s = asyncio.run(main())
        assert heard.wait(5)
    finally:
        worker.close()
    assert changes[:2] == ["its lease ended", "the controller at tcp://b:5555 took over"]
    assert took_over_s > 1.0  # it waited for the lease: nothing deleted the key


def test_a_leader_whose_lease_is_revoked_steps_down(etcd: str) -> None:
    async def main() -> bool:
        lost = asyncio.Event()
        leader = ControllerMembership(etcd, "t", lease_ttl_s=2)
        await leader.connect()
        leader.on_leadership_lost = lost.set
        await leader.lead(endpoint("a"), lambda held: None)
        assert leader._client is not None
        found = await leader._client.get(leader.key)
        await leader._client.revoke_lease(found.lease)  # as etcd does when refreshes stop
        await asyncio.wait_for(lost.wait(), 5)
        stepped_down = not leader.is_leader
        await leader.close()
        return stepped_down

    assert asyncio.run(main())
