"""One pipeline's view: each stage's shares of time from its controller's Status (utilization,
bubble, idle, step time; computed by the controller, controller/stage_report.py) beside what the
Kubernetes API says of the pod serving that stage, and, when it is down, which pod and why."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict
from sarathi_proto import generate_pb2

from sarathictl.commands.status import stage_label
from sarathictl.kube.discovery import Obj, PipelineObjects
from sarathictl.kube.pod_state import PodView, view_of


@dataclass
class StageRow:
    stage: int
    label: str
    """The stage as `sarathictl status` names it: its number, with DOWN or STALLED."""
    pod: PodView
    shares: generate_pb2.StageStatus | None
    """None when the controller could not be asked."""


@dataclass
class PipelineView:
    objects: PipelineObjects
    controller: PodView
    status: generate_pb2.StatusResponse | None
    unreachable: str = ""
    """Why the controller's Status could not be read; empty when it was."""
    stages: list[StageRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """What keeps the pipeline from serving, one line each: pods missing and why, the
    controller's own diagnosis."""

    def to_json(self) -> dict[str, Any]:
        return {
            "release": self.objects.release,
            "pipeline": self.objects.index,
            "controller": asdict(self.controller),
            "unreachable": self.unreachable,
            "problems": self.problems,
            "stages": [
                {
                    "stage": row.stage,
                    "pod": asdict(row.pod),
                    **(_fields(row.shares) if row.shares is not None else {}),
                }
                for row in self.stages
            ],
            "status": None if self.status is None else _fields(self.status),
        }


def _fields(message: Any) -> dict[str, Any]:
    fields: dict[str, Any] = MessageToDict(message, always_print_fields_with_no_presence=True)
    return fields


def pick_controller(pods: list[Obj]) -> Obj | None:
    """The controller to ask: the ready one (with a standby, only the active one is ready), else
    one that runs, else any (to say why it does not serve)."""
    views = [(view_of(p), p) for p in pods]
    for wanted in (lambda v: v.ready, lambda v: v.phase == "Running" and v.ip, lambda v: True):
        for view, pod in views:
            if wanted(view):
                return pod
    return None


def join(
    objects: PipelineObjects,
    controller: Obj | None,
    status: generate_pb2.StatusResponse | None,
    unreachable: str,
) -> PipelineView:
    deployment = objects.controller_deployment or f"{objects.name} controller"
    ctl = (
        view_of(controller)
        if controller is not None
        else PodView.missing(f"{deployment}-*", f"no pod of Deployment {deployment}")
    )
    view = PipelineView(objects, ctl, status, unreachable)
    if not ctl.ready:
        view.problems.append(f"controller pod {ctl.name}: {ctl.why}")
    if unreachable:
        view.problems.append(f"controller unreachable: {unreachable}")
    if status is not None and status.problem:
        view.problems.append(f"controller: NOT SERVING: {status.problem}")
    by_stage = {s.stage: s for s in status.stages} if status is not None else {}
    for stage in range(max(objects.num_stages, len(by_stage))):
        row = _stage_row(objects, stage, by_stage.get(stage))
        if not row.pod.ready:
            view.problems.append(f"stage {stage}: pod {row.pod.name}: {row.pod.why}")
        view.stages.append(row)
    return view


def _stage_row(
    objects: PipelineObjects, stage: int, shares: generate_pb2.StageStatus | None
) -> StageRow:
    pod = objects.stage_pods.get(stage)
    if pod is not None:
        pod_view = view_of(pod)
    else:
        name = f"{objects.stage_set}-{stage}" if objects.stage_set else f"stage {stage}"
        owner = f" of StatefulSet {objects.stage_set}" if objects.stage_set else ""
        pod_view = PodView.missing(name, f"no such pod{owner} (not created, or deleted)")
    label = stage_label(shares) if shares is not None else str(stage)
    return StageRow(stage, label, pod_view, shares)
