"""Posts the controller's pipeline events (controller/pipeline_events.py) as Kubernetes Events on
its own pod and on the stage pods involved, so `kubectl get events` and `kubectl describe pod`
tell of a stage down, a rebuild, a refused worker or admission overload.

Best effort, and never in the serving loop's way: events wait in a bounded queue and one
background thread posts them, every API call with a timeout; when the queue is full an event is
dropped and counted in the log. Without API access (not in a pod, no service account token,
RBAC missing) the controller logs one line and serves on without events.

In a pod means POD_NAME and POD_NAMESPACE are set (the chart's downward API). The API is reached
through the in-cluster service account, or else the usual kubeconfig ($KUBECONFIG) — how the tests
point a local controller at an API emulator. The `kubernetes` package is imported here only, and
only once a pod was found: nothing else of the controller loads it.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from controller import chart_labels
from controller.pipeline_events import EventSink, NoEvents, PipelineEvent

log = logging.getLogger(__name__)

REPORTING_COMPONENT = "sarathi-cluster/controller"
# Events posted at most this long after they happen; one stuck call cannot hold the rest for long.
API_TIMEOUT_S = 5.0
MAX_QUEUED_EVENTS = 256
# Drops are logged at the first and then every this many, each line with the count so far.
_DROP_LOG_EVERY = 100

Pod = Mapping[str, Any]


@dataclass(frozen=True)
class PodIdentity:
    name: str
    namespace: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PodIdentity | None:
        name, namespace = env.get("POD_NAME", ""), env.get("POD_NAMESPACE", "")
        return cls(name, namespace) if name and namespace else None


class KubeApi:
    """The few calls the events need (get and list pods, create events), on the API's raw JSON
    (`_preload_content=False`: the client's typed models are not needed, nor are their checks of
    what an API server left out)."""

    def __init__(self, namespace: str, timeout_s: float) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()  # raises ConfigException too when there is none
        self.core = client.CoreV1Api()
        self.namespace = namespace
        self.timeout_s = timeout_s

    def pod(self, name: str) -> Pod:
        resp: Any = self.core.read_namespaced_pod(
            name, self.namespace, _preload_content=False, _request_timeout=self.timeout_s
        )
        pod: Pod = json.loads(resp.data)
        return pod

    def pods(self, labels: Mapping[str, str]) -> list[Pod]:
        resp: Any = self.core.list_namespaced_pod(
            self.namespace,
            label_selector=chart_labels.selector(labels),
            _preload_content=False,
            _request_timeout=self.timeout_s,
        )
        items: list[Pod] = json.loads(resp.data).get("items") or []
        # Only what was asked for, even from an API server that ignores label selectors.
        return [p for p in items if chart_labels.matches(p, labels)]

    def create_event(self, body: Any) -> None:
        self.core.create_namespaced_event(
            self.namespace, body, _preload_content=False, _request_timeout=self.timeout_s
        )


def why_no_api(err: BaseException) -> str:
    """One line on why the API cannot be used, naming RBAC when that is the reason."""
    status = getattr(err, "status", None)
    if status in (401, 403):
        reason = getattr(err, "reason", "") or "Forbidden"
        return (
            f"the Kubernetes API answered {status} {reason}: the controller's service account "
            "may not read pods or create events (the chart's Role <release>-controller grants it)"
        )
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


class KubeEventPoster:
    """An EventSink that posts from a background thread."""

    def __init__(
        self,
        pod: PodIdentity,
        connect: Callable[[], KubeApi],
        max_queued: int = MAX_QUEUED_EVENTS,
    ) -> None:
        self.pod = pod
        self._connect = connect
        self._queue: queue.Queue[PipelineEvent | None] = queue.Queue(max_queued)
        self._off = threading.Event()
        self._names = itertools.count()
        self.num_dropped = 0
        self.num_posted = 0
        self._thread = threading.Thread(target=self._run, name="kube-events", daemon=True)

    def start(self) -> KubeEventPoster:
        self._thread.start()
        return self

    def post(self, event: PipelineEvent) -> None:
        if self._off.is_set():
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped % _DROP_LOG_EVERY == 1:
                log.warning(
                    "Kubernetes event %s dropped: %d events queued; %d dropped so far",
                    event.reason, self._queue.maxsize, self.num_dropped,
                )  # fmt: skip

    def close(self, flush_s: float = 2.0) -> None:
        """Posts what is queued for up to flush_s, then stops the thread."""
        with contextlib.suppress(queue.Full):  # a full queue: the thread stops with the process
            self._queue.put(None, timeout=flush_s)
        if self._thread.is_alive():
            self._thread.join(flush_s)

    def _turn_off(self, why: str) -> None:
        self._off.set()
        log.warning("Kubernetes events off: %s; serving goes on without them", why)

    def _run(self) -> None:
        try:
            api = self._connect()
            own = api.pod(self.pod.name)
        except Exception as err:  # no config, no token, no RBAC, no API server: all the same here
            self._turn_off(why_no_api(err))
            return
        log.info(
            "Kubernetes events on: recorded on pod %s/%s and its stage pods",
            self.pod.namespace, self.pod.name,
        )  # fmt: skip
        while (event := self._queue.get()) is not None:
            try:
                for involved in self._involved(api, own, event):
                    api.create_event(self._body(own, involved, event))
                    self.num_posted += 1
            except Exception as err:
                if getattr(err, "status", None) in (401, 403):
                    self._turn_off(why_no_api(err))
                    return
                log.warning("Kubernetes event %s not recorded: %s", event.reason, why_no_api(err))

    def _involved(self, api: KubeApi, own: Pod, event: PipelineEvent) -> list[Pod]:
        """The controller's pod, then the stage pods the event is about."""
        if event.stages:
            stage_pods = api.pods(chart_labels.stage_pod_labels(own))
            by_stage = {chart_labels.stage_of_pod(p): p for p in stage_pods}
            return [own, *(by_stage[s] for s in event.stages if s in by_stage)]
        if event.worker_host or event.worker_id:
            release = chart_labels.labels_of(own).get(chart_labels.INSTANCE, "")
            worker = [
                p for p in api.pods(chart_labels.release_labels(release))
                if _runs_worker(p, event.worker_host, event.worker_id)
            ]  # fmt: skip
            return [own, *worker[:1]]
        return [own]

    def _body(self, own: Pod, involved: Pod, event: PipelineEvent) -> dict[str, Any]:
        meta = involved.get("metadata", {})
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "apiVersion": "v1",
            "kind": "Event",
            # client-go's naming: the object's name and a unique suffix (generateName is not
            # needed, and an API emulator may not know it).
            "metadata": {
                "name": f"{meta.get('name', '')}.{time.time_ns():x}{next(self._names):x}",
                "namespace": self.pod.namespace,
            },
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta.get("name", ""),
                "namespace": self.pod.namespace,
                "uid": meta.get("uid", ""),
            },
            "reason": event.reason,
            "message": event.message,
            "type": "Warning" if event.warning else "Normal",
            "source": {
                "component": REPORTING_COMPONENT,
                "host": own.get("spec", {}).get("nodeName", ""),
            },
            "reportingComponent": REPORTING_COMPONENT,
            "reportingInstance": self.pod.name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }


def _runs_worker(pod: Pod, host: str, worker_id: str) -> bool:
    name = pod.get("metadata", {}).get("name", "")
    ip = pod.get("status", {}).get("podIP", "")
    return bool((host and ip == host) or (name and worker_id.startswith(f"{name}-")))


def start_kube_events(env: Mapping[str, str]) -> EventSink:
    """The sink for this process: a running poster in a pod, else one that drops (logged once)."""
    pod = PodIdentity.from_env(env)
    if pod is None:
        log.info(
            "Kubernetes events off: POD_NAME and POD_NAMESPACE are not set (not in a pod, or the "
            "chart's controller.events.enabled is false)"
        )
        return NoEvents()
    return KubeEventPoster(pod, lambda: KubeApi(pod.namespace, API_TIMEOUT_S)).start()
