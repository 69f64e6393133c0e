"""The controller's Kubernetes events, without an API server: which pods an event lands on, what
it says, that a full queue drops (counted) instead of blocking, and that no API access costs one
log line and nothing else."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from controller.kube_events import KubeEventPoster, PodIdentity, start_kube_events
from controller.overload_watch import OverloadTracker
from controller.pipeline_events import NoEvents, PipelineEvent, PipelineEvents
from tests.integration.kube_emulator import pods_of
from tests.unit.test_helm_chart import render

NS = "sarathi"
CONTROLLER = "sarathi-cluster-p0-controller-5d8f7c9b4-x0q2z"


class Forbidden(Exception):
    status = 403
    reason = "Forbidden"


class FakeApi:
    """The three calls KubeApi makes, over the chart's rendered pods."""

    def __init__(self, forbid_events: bool = False, gate: threading.Event | None = None) -> None:
        workloads = [o for o in render("") if o["kind"] in ("Deployment", "StatefulSet")]
        self.pods_by_name = {p["metadata"]["name"]: p for p in pods_of(workloads, {})}
        self.events: list[dict[str, Any]] = []
        self.forbid_events = forbid_events
        self.gate = gate

    def pod(self, name: str) -> Any:
        return self.pods_by_name[name]

    def pods(self, labels: dict[str, str]) -> list[Any]:
        have = self.pods_by_name.values()
        return [
            p for p in have if all(p["metadata"]["labels"].get(k) == v for k, v in labels.items())
        ]

    def create_event(self, body: Any) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        if self.forbid_events:
            raise Forbidden("events is forbidden")
        self.events.append(body)


def posted(api: FakeApi, events: list[PipelineEvent], max_queued: int = 64) -> KubeEventPoster:
    poster = KubeEventPoster(PodIdentity(CONTROLLER, NS), lambda: api, max_queued).start()  # type: ignore[arg-type,return-value]
    for event in events:
        poster.post(event)
    poster.close(flush_s=5)
    return poster


def on(api: FakeApi, reason: str) -> list[str]:
    return [e["involvedObject"]["name"] for e in api.events if e["reason"] == reason]


class Collect:
    def __init__(self) -> None:
        self.events: list[PipelineEvent] = []

    def post(self, event: PipelineEvent) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


def test_a_stage_down_lands_on_the_controller_and_that_stage_pod_with_the_reason() -> None:
    sink = Collect()
    PipelineEvents(sink).stage_down("stage 1 rank 0 (w) sent no heartbeat for 2.5 s", [1])
    api = FakeApi()
    posted(api, sink.events)
    assert on(api, "StageDown") == [CONTROLLER, "sarathi-cluster-p0-stage-1"]
    event = api.events[0]
    assert event["type"] == "Warning" and "sent no heartbeat for 2.5 s" in event["message"]
    assert event["involvedObject"]["uid"] == f"uid-{CONTROLLER}"
    assert event["metadata"]["namespace"] == NS and event["count"] == 1


def test_a_rebuild_says_how_long_it_took_and_how_many_requests_were_requeued() -> None:
    sink = Collect()
    PipelineEvents(sink).rebuilt(rebuild=2, down_s=7.25, requeued=5, num_stages=2)
    api = FakeApi()
    posted(api, sink.events)
    assert on(api, "PipelineRebuilt") == [CONTROLLER, "sarathi-cluster-p0-stage-0",
                                          "sarathi-cluster-p0-stage-1"]  # fmt: skip
    message = api.events[0]["message"]
    assert "rebuilt (#2) in 7.2 s" in message and "5 requests were requeued" in message
    assert api.events[0]["type"] == "Normal"


def test_a_refused_worker_lands_on_the_pod_its_id_names() -> None:
    sink = Collect()
    PipelineEvents(sink).worker_refused(
        "refused worker x: stage 0 rank 0 is already served by y",
        worker_id="sarathi-cluster-p0-stage-0-4242-ab12cd", host="10.9.9.9",
    )  # fmt: skip
    api = FakeApi()
    posted(api, sink.events)
    assert on(api, "WorkerRefused") == [CONTROLLER, "sarathi-cluster-p0-stage-0"]


def test_overload_start_and_end_are_events_on_the_controller() -> None:
    sink = Collect()
    events = PipelineEvents(sink)
    events.overload_started("8 requests queued (max_queued_requests=8)")
    events.overload_ended(12.5)
    api = FakeApi()
    posted(api, sink.events)
    assert on(api, "AdmissionOverload") == [CONTROLLER]
    assert on(api, "AdmissionOverloadEnded") == [CONTROLLER]
    assert "max_queued_requests=8" in api.events[0]["message"]
    assert "after 12.5 s" in api.events[1]["message"]


def test_a_full_queue_drops_and_counts_instead_of_blocking(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = threading.Event()  # the API hangs until the test lets it go
    api = FakeApi(gate=gate)
    poster = KubeEventPoster(PodIdentity(CONTROLLER, NS), lambda: api, max_queued=4).start()  # type: ignore[arg-type,return-value]
    event = PipelineEvent("AdmissionOverload", "m", warning=True)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="controller.kube_events"):
        for _ in range(50):
            poster.post(event)
    # never waits for the API, which hangs until the gate opens (a bound a loaded machine meets)
    assert time.monotonic() - start < 5
    assert 40 <= poster.num_dropped <= 46
    assert "dropped so far" in caplog.text
    gate.set()
    poster.close(flush_s=5)
    assert len(api.events) == 50 - poster.num_dropped


def test_rbac_refusal_turns_events_off_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    api = FakeApi(forbid_events=True)
    events = [PipelineEvent("StageDown", f"m{i}", warning=True) for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="controller.kube_events"):
        poster = posted(api, events)
    lines = [r.getMessage() for r in caplog.records if "Kubernetes events off" in r.getMessage()]
    assert len(lines) == 1 and "403" in lines[0] and "Role" in lines[0]
    poster.post(events[0])  # after that, nothing is queued or logged
    assert len(caplog.records) == 1


def test_outside_a_pod_there_are_no_events_and_one_line_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="controller.kube_events"):
        sink = start_kube_events({})
    assert isinstance(sink, NoEvents)
    first = caplog.records[0].getMessage()
    assert first.startswith("Kubernetes events off: POD_NAME")


def test_overload_is_one_event_until_the_queue_stays_below_its_bounds() -> None:
    starts: list[str] = []
    ends: list[float] = []
    tracker = OverloadTracker(starts.append, ends.append, clear_after_s=3.0)
    # At the bound, then admitting and refilling every half second for 5 s: one overload.
    for i in range(11):
        tracker.sample(i * 0.5, "8 requests queued" if i % 2 == 0 else "")
    assert starts == ["8 requests queued"] and ends == []
    tracker.sample(7.9, "")
    assert ends == []
    tracker.sample(8.0, "")
    assert ends == [5.0]
    tracker.sample(9.0, "8 requests queued")
    assert len(starts) == 2
