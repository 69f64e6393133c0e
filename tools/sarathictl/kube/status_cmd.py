"""`sarathictl status --kubernetes`: every pipeline of a Helm release, found through the
Kubernetes API, its controller's Status read through a port-forward (or the pod's IP), and one
table per pipeline joining each stage's shares of time with its pod."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from rich.console import Console
from rich.live import Live
from sarathi_proto import generate_pb2

from sarathictl.client import Client
from sarathictl.kube.connect import KubeApi, KubeConfigError, connect
from sarathictl.kube.discovery import Obj, PipelineObjects, find_pipelines
from sarathictl.kube.forward import PortForward
from sarathictl.kube.join import PipelineView, join, pick_controller
from sarathictl.kube.table import render_release

T = TypeVar("T")
STATUS_TIMEOUT_S = 5.0


class ControllerReach:
    """Addresses of controller pods' gRPC ports: a port-forward per pod, kept across --watch
    refreshes, or the pod's IP (from inside the cluster)."""

    def __init__(self, api: KubeApi, via: str, tls_ca: str, token: str) -> None:
        self.api, self.via, self.tls_ca, self.token = api, via, tls_ca, token
        self._forwards: dict[tuple[str, int], PortForward] = {}

    def status(self, pod: Obj) -> tuple[generate_pb2.StatusResponse | None, str]:
        """(Status, "") or (None, why it could not be read)."""
        name = pod.get("metadata", {}).get("name", "")
        port = grpc_port(pod)
        if port is None:
            return None, f"pod {name} declares no container port named grpc"
        forward = None
        if self.via == "pod-ip":
            ip = pod.get("status", {}).get("podIP", "")
            if not ip:
                return None, f"pod {name} has no IP yet"
            addr = f"{ip}:{port}"
        else:
            forward = self._forward(name, port)
            addr = forward.address
        try:
            with Client(addr, self.tls_ca, self.token) as client:
                return client.status(STATUS_TIMEOUT_S), ""
        except grpc.RpcError as err:
            through = f"port-forward to pod {name}:{port}" if forward else addr
            said = forward.last_error if forward is not None else ""
            refused = f"; the API server said: {said}" if said else ""
            details = err.details() if hasattr(err, "details") else str(err)
            return None, f"no Status through {through} ({details}){refused}"

    def _forward(self, pod: str, port: int) -> PortForward:
        key = (pod, port)
        if key not in self._forwards:
            self._forwards[key] = PortForward(self.api.core, self.api.namespace, pod, port)
        return self._forwards[key]

    def close(self) -> None:
        for forward in self._forwards.values():
            forward.close()


def grpc_port(pod: Obj) -> int | None:
    for container in pod.get("spec", {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "grpc":
                return int(port["containerPort"])
    return None


def observe(pipeline: PipelineObjects, reach: ControllerReach) -> PipelineView:
    controller = pick_controller(pipeline.controllers)
    status, unreachable = None, ""
    if controller is None:
        unreachable = "no controller pod"
    else:
        status, unreachable = reach.status(controller)
    return join(pipeline, controller, status, unreachable)


def explained(api: KubeApi, call: Callable[[], T]) -> T:
    """call(), with the API's refusals and a server out of reach said in one line."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return call()
    except ApiException as err:
        rbac = (
            ": the user of this kubeconfig may not list pods, services, statefulsets and "
            "deployments there (RBAC)"
            if err.status in (401, 403)
            else ""
        )
        raise KubeConfigError(
            f"the Kubernetes API at {api.server} answered {err.status} {err.reason} in namespace "
            f"{api.namespace!r}{rbac}"
        ) from None
    except HTTPError as err:
        raise KubeConfigError(f"cannot reach the Kubernetes API at {api.server}: {err}") from None


def run_kubernetes(args: argparse.Namespace) -> int:
    api = connect(args.kubeconfig, args.context, args.namespace)
    token = ""
    if args.token_file:
        with open(args.token_file) as f:
            token = f.readline().strip()
    reach = ControllerReach(api, args.via, args.tls_ca, token)

    def snapshot() -> list[PipelineView]:
        return [
            observe(p, reach) for p in explained(api, lambda: find_pipelines(api, args.release))
        ]

    try:
        return _show(args, snapshot)
    finally:
        reach.close()


def _show(args: argparse.Namespace, snapshot: Callable[[], list[PipelineView]]) -> int:
    views = snapshot()
    if args.json:
        print(json.dumps({"namespace": args.namespace, "pipelines": [v.to_json() for v in views]}))
        return _exit_code(views)
    console = Console()
    if not args.watch:
        console.print(render_release(views))
        return _exit_code(views)
    with Live(render_release(views), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(args.interval)
            live.update(render_release(snapshot()), refresh=True)


def _exit_code(views: list[PipelineView]) -> int:
    """1 when a controller could not be asked (as plain `status` does), else 0."""
    unreachable = [v for v in views if v.unreachable]
    for view in unreachable:
        print(f"sarathictl: {view.objects.name}: {view.unreachable}", file=sys.stderr)
    return 1 if unreachable else 0
