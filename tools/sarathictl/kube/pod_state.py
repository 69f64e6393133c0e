"""What the Kubernetes API says of one pod: node, readiness, restarts, and when it does not serve,
why (Pending and its reason, CrashLoopBackOff, OOMKilled, ...), from the pod's JSON."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Pod = Mapping[str, Any]


@dataclass(frozen=True)
class PodView:
    name: str
    node: str
    phase: str
    ready: bool
    restarts: int
    why: str
    """Empty when the pod is ready; else what keeps it from serving, as the API says."""
    ip: str = ""

    @classmethod
    def missing(cls, name: str, why: str) -> PodView:
        return cls(name, "", "Missing", False, 0, why)


def view_of(pod: Pod) -> PodView:
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    containers = status.get("containerStatuses") or []
    ready = _condition(status, "Ready").get("status") == "True"
    return PodView(
        name=meta.get("name", ""),
        node=spec.get("nodeName", "") or "",
        phase=status.get("phase", "") or "Unknown",
        ready=ready,
        restarts=sum(int(c.get("restartCount", 0)) for c in containers),
        why="" if ready else why_not_ready(pod),
        ip=status.get("podIP", "") or "",
    )


def why_not_ready(pod: Pod) -> str:
    """One line: the most telling reason the API gives for a pod that is not ready."""
    status = pod.get("status", {})
    phase = status.get("phase", "") or "Unknown"
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return "Terminating"
    scheduled = _condition(status, "PodScheduled")
    if phase == "Pending" and scheduled.get("status") == "False":
        return _joined("Pending", scheduled.get("reason"), scheduled.get("message"))
    for c in status.get("containerStatuses") or []:
        waiting = (c.get("state") or {}).get("waiting") or {}
        last = (c.get("lastState") or {}).get("terminated") or {}
        terminated = (c.get("state") or {}).get("terminated") or {}
        if waiting.get("reason"):
            reason = f"{waiting['reason']} ({_exit(last)})" if last else waiting["reason"]
            return _joined(reason, waiting.get("message"))
        if terminated:
            return _joined("Terminated", _exit(terminated))
    if phase in ("Failed", "Unknown") or phase == "Pending":
        return _joined(phase, status.get("reason"), status.get("message"))
    return _joined(
        f"{phase}, not ready", _condition(status, "Ready").get("message") or "readiness probe"
    )


def _exit(terminated: Mapping[str, Any]) -> str:
    if not terminated:
        return ""
    reason = terminated.get("reason") or "exited"
    return f"last exit: {reason}, code {terminated.get('exitCode', '?')}"


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    found: Mapping[str, Any] = next(
        (c for c in status.get("conditions") or [] if c.get("type") == kind), {}
    )
    return found


def _joined(*parts: object) -> str:
    return ": ".join(str(p) for p in parts if p)
