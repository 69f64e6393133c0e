"""What the controller tells operators through Kubernetes Events: a stage down, the pipeline
rebuilt, a worker refused, admission overload starting and ending.

This module words the events; where they go is a sink's business (controller/kube_events.py posts
them to the Kubernetes API from a thread of its own). Posting never blocks the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

# Event reasons, as `kubectl get events` shows them (CamelCase by Kubernetes convention).
STAGE_DOWN = "StageDown"
PIPELINE_REBUILT = "PipelineRebuilt"
WORKER_REFUSED = "WorkerRefused"
OVERLOAD_STARTED = "AdmissionOverload"
OVERLOAD_ENDED = "AdmissionOverloadEnded"

# The API caps an event's message at 1 KiB; a longer one is refused whole.
MAX_MESSAGE_CHARS = 1000


@dataclass(frozen=True)
class PipelineEvent:
    reason: str
    message: str
    warning: bool
    stages: tuple[int, ...] = ()
    """Stages whose pods the event is recorded on too (besides the controller's own pod)."""
    worker_host: str = ""
    """A worker with no place in the pipeline (a refused one): its pod is found by this address
    or by worker_id, which starts with the pod's hostname."""
    worker_id: str = ""


class EventSink(Protocol):
    def post(self, event: PipelineEvent) -> None:
        """Queues the event; never blocks, never raises."""

    def close(self) -> None:
        """At shutdown: posts what is queued, within a short time."""


class NoEvents:
    """The sink when there is no Kubernetes API to post to."""

    def post(self, event: PipelineEvent) -> None:
        pass

    def close(self) -> None:
        pass


class PipelineEvents:
    """The events of one controller, worded here and handed to a sink."""

    def __init__(self, sink: EventSink) -> None:
        self.sink = sink

    def _post(self, event: PipelineEvent) -> None:
        try:
            self.sink.post(event)
        except Exception:  # best effort: an event is never worth a serving failure
            log.exception("posting event %s failed; dropped", event.reason)

    def stage_down(self, reason: str, stages: Sequence[int]) -> None:
        self._post(
            PipelineEvent(
                STAGE_DOWN,
                _cut(f"pipeline down: {reason}; requests requeued, rebuilding"),
                warning=True,
                stages=tuple(sorted(set(stages))),
            )
        )

    def rebuilt(self, rebuild: int, down_s: float, requeued: int, num_stages: int) -> None:
        self._post(
            PipelineEvent(
                PIPELINE_REBUILT,
                f"pipeline rebuilt (#{rebuild}) in {down_s:.1f} s; {requeued} requests were "
                "requeued for recompute; serving again",
                warning=False,
                stages=tuple(range(num_stages)),
            )
        )

    def worker_refused(self, reason: str, worker_id: str, host: str) -> None:
        self._post(
            PipelineEvent(
                WORKER_REFUSED, _cut(reason), warning=True, worker_host=host, worker_id=worker_id
            )
        )

    def overload_started(self, detail: str) -> None:
        self._post(
            PipelineEvent(
                OVERLOAD_STARTED,
                _cut(f"admission overload: {detail}; new requests are refused with a retry hint"),
                warning=True,
            )
        )

    def overload_ended(self, lasted_s: float) -> None:
        self._post(
            PipelineEvent(
                OVERLOAD_ENDED,
                f"admission overload ended after {lasted_s:.1f} s; requests are admitted again",
                warning=False,
            )
        )


def _cut(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 3] + "..."
