"""A Kubernetes API server for the tests: kmock's KubernetesEmulator (objects kept in memory,
served over HTTP on localhost to the official client), run in a thread of its own, with what it
lacks added here: the pods' `portforward` subresource (to a port on this machine: the tests' pod
network is localhost) and answers of 403 where a test takes RBAC away.

Also: a release rendered by the chart loaded into it, with the pods its Deployments and
StatefulSets would have made, in the states a test asks for.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import pytest

try:
    import kmock
    from kmock import Request as KRequest
except ImportError:
    # kmock installs on Python 3.11+ only (pyproject's dev extra): on 3.10 every test module
    # that imports this emulator is skipped, saying why, rather than failing to collect.
    pytest.skip("the Kubernetes emulator (kmock) needs Python 3.11+", allow_module_level=True)

Obj = dict[str, Any]

_PORT_FORWARD = re.compile(r"^/api/v1/namespaces/[^/]+/pods/([^/]+)/portforward$")
_CHANNEL_PROTOCOL = "v4.channel.k8s.io"


class Emulator(kmock.KubernetesEmulator):
    """The emulator plus port-forwarding and RBAC refusals."""

    forbid: Callable[[KRequest], bool] = staticmethod(lambda request: False)  # type: ignore[assignment]
    forwarded: list[str]
    """Pods a port-forward was asked for, in order."""

    async def _handle(self, request: KRequest) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        if self.forbid(request):
            return aiohttp.web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                 "reason": "Forbidden", "message": f"{raw.method} {raw.path} is forbidden"},
                status=403,
            )  # fmt: skip
        if found := _PORT_FORWARD.match(raw.path):
            self.forwarded.append(found.group(1))
            return await _port_forward(raw)
        return await super()._handle(request)


async def _port_forward(raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
    """The API server's side of a v4 channel port-forward: channel 0 carries the data, channel 1
    errors; each first says which port it is for (2 bytes, little-endian)."""
    port = int(raw.query["ports"])
    ws = aiohttp.web.WebSocketResponse(protocols=(_CHANNEL_PROTOCOL,))
    await ws.prepare(raw)  # type: ignore[arg-type]
    for channel in (0, 1):
        await ws.send_bytes(bytes([channel]) + port.to_bytes(2, "little"))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as err:
        await ws.send_bytes(b"\x01" + f"connect to port {port}: {err}".encode())
        await ws.close()
        return ws

    async def to_client() -> None:
        while data := await reader.read(65536):
            await ws.send_bytes(b"\x00" + data)
        await ws.close()

    downstream = asyncio.create_task(to_client())
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.BINARY and msg.data[:1] == b"\x00" and msg.data[1:]:
            writer.write(msg.data[1:])
            await writer.drain()
    writer.close()
    downstream.cancel()
    return ws


class EmulatorThread:
    """The emulator on a free port of 127.0.0.1, in a thread with its own event loop."""

    def __init__(self) -> None:
        self.emulator = Emulator()
        self.emulator.forwarded = []
        # Known resources list empty, as a real API server's do, before any object exists.
        for resource in ("v1/pods", "v1/services", "v1/events", "apps/v1/deployments",
                         "apps/v1/statefulsets"):  # fmt: skip
            self.emulator.resources[resource] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: kmock.Server | None = None
        self.url = ""

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self) -> None:
        await self.emulator.__aenter__()
        self._server = kmock.Server(self.emulator)
        await self._server.__aenter__()
        self.url = str(self._server.url).rstrip("/")

    async def _stop(self) -> None:
        assert self._server is not None
        await self._server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    # ---- the API, as a test uses it -------------------------------------------------------
    def write_kubeconfig(self, path: Path, namespace: str) -> Path:
        """A kubeconfig whose current context is this server (plain HTTP, no credentials)."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {}}],
            "contexts": [{"name": "emulator",
                          "context": {"cluster": "emulator", "user": "tester",
                                      "namespace": namespace}}],
        }  # fmt: skip
        path.write_text(json.dumps(config))
        return path

    def create(self, obj: Obj, namespace: str) -> None:
        obj = {**obj, "metadata": {**obj["metadata"], "namespace": namespace}}
        body = json.dumps(obj).encode()
        request = urllib.request.Request(
            f"{self.url}{collection_path(obj, namespace)}",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status in (200, 201), resp.status

    def delete(self, object_path: str) -> None:
        request = urllib.request.Request(f"{self.url}{object_path}", method="DELETE")
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200, resp.status

    def listed(self, plural_path: str) -> list[Obj]:
        try:
            with urllib.request.urlopen(f"{self.url}{plural_path}", timeout=10) as resp:
                items: list[Obj] = json.loads(resp.read()).get("items") or []
                return items
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return []
            raise

    def events(self, namespace: str) -> list[Obj]:
        return self.listed(f"/api/v1/namespaces/{namespace}/events")


_PLURALS = {
    "Pod": "pods", "Service": "services", "Deployment": "deployments",
    "StatefulSet": "statefulsets", "Event": "events",
}  # fmt: skip


def collection_path(obj: Obj, namespace: str) -> str:
    api = obj["apiVersion"]
    prefix = f"/api/{api}" if "/" not in api else f"/apis/{api}"
    return f"{prefix}/namespaces/{namespace}/{_PLURALS[obj['kind']]}"


# ---- a rendered release's pods ----------------------------------------------------------------
def pods_of(workloads: Iterable[Obj], states: dict[str, Obj], node: str = "node-a") -> list[Obj]:
    """The pods a Deployment or StatefulSet makes (names as their controllers give them), with
    the template's labels and containers; states: pod name -> its `status` (default: running
    and ready on 127.0.0.1). A state of None leaves the pod out (not created)."""
    pods = []
    for workload in workloads:
        name = workload["metadata"]["name"]
        template = workload["spec"]["template"]
        for ordinal in range(int(workload["spec"].get("replicas", 1))):
            labels = dict(template["metadata"]["labels"])
            if workload["kind"] == "StatefulSet":
                pod_name = f"{name}-{ordinal}"
                labels["statefulset.kubernetes.io/pod-name"] = pod_name
                labels["apps.kubernetes.io/pod-index"] = str(ordinal)
            else:
                pod_name = f"{name}-5d8f7c9b4-x{ordinal}q2z"
            if states.get(pod_name, {}) is None:
                continue
            pods.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod_name, "labels": labels, "uid": f"uid-{pod_name}"},
                    "spec": {**template["spec"], "nodeName": node},
                    "status": states.get(pod_name) or running_ready(),
                }
            )
    return pods


def running_ready(restarts: int = 0, ip: str = "127.0.0.1") -> Obj:
    return {
        "phase": "Running",
        "podIP": ip,
        "conditions": [{"type": "PodScheduled", "status": "True"},
                       {"type": "Ready", "status": "True"}],
        "containerStatuses": [{"name": "c", "ready": True, "restartCount": restarts,
                               "state": {"running": {}}}],
    }  # fmt: skip


def pending_unschedulable(message: str) -> Obj:
    return {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": message}],
    }  # fmt: skip


def crash_looping(last_reason: str, exit_code: int, restarts: int) -> Obj:
    return {
        "phase": "Running",
        "podIP": "10.1.2.3",
        "conditions": [{"type": "PodScheduled", "status": "True"},
                       {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}],
        "containerStatuses": [{
            "name": "workers", "ready": False, "restartCount": restarts,
            "state": {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": "back-off 5m0s restarting failed container"}},
            "lastState": {"terminated": {"reason": last_reason, "exitCode": exit_code}},
        }],
    }  # fmt: skip
