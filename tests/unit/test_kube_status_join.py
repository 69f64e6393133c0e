"""`sarathictl status --kubernetes` without a cluster: the chart's own rendered objects grouped
into pipelines, joined with a controller's Status, and the table an operator reads."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from sarathi_proto import generate_pb2
from sarathictl.kube.discovery import group_pipelines
from sarathictl.kube.join import join, pick_controller
from sarathictl.kube.pod_state import view_of
from sarathictl.kube.table import render_release

from tests.integration.kube_emulator import (
    crash_looping,
    pending_unschedulable,
    pods_of,
    running_ready,
)
from tests.unit.test_helm_chart import render

Obj = dict[str, Any]


def release_objects(pipelines: int, states: dict[str, Any]) -> tuple[list[Obj], ...]:
    objs = [dict(o) for o in render("", f"pipelines={pipelines}")]
    workloads = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    services = [o for o in objs if o["kind"] == "Service"]
    pods = pods_of(workloads, states)
    sets = [o for o in workloads if o["kind"] == "StatefulSet"]
    deployments = [o for o in workloads if o["kind"] == "Deployment"]
    return services, pods, sets, deployments


def status_of(num_stages: int) -> generate_pb2.StatusResponse:
    status = generate_pb2.StatusResponse(model="smollm2-135m-instruct", serving=True)
    for s in range(num_stages):
        status.stages.add(
            stage=s, up=True, utilization_pct=60.0 + s, bubble_pct=30.0 - s, idle_pct=10.0,
            step_time_p50_s=0.0421, micro_batches_in_flight=2,
        )  # fmt: skip
    return status


def text_of(*views: Any) -> str:
    console = Console(width=160, record=True)
    console.print(render_release(list(views)))
    return console.export_text()


def test_every_pipeline_of_a_rendered_release_is_found_with_its_pods() -> None:
    pipelines = group_pipelines(*release_objects(2, {}))
    assert [p.name for p in pipelines] == ["sarathi-cluster/p0", "sarathi-cluster/p1"]
    for i, p in enumerate(pipelines):
        assert p.num_stages == 2 and sorted(p.stage_pods) == [0, 1]
        assert p.stage_set == f"sarathi-cluster-p{i}-stage"
        assert [c["metadata"]["name"] for c in p.controllers] == [
            f"sarathi-cluster-p{i}-controller-5d8f7c9b4-x0q2z"
        ]
        assert p.stage_pods[1]["metadata"]["name"] == f"sarathi-cluster-p{i}-stage-1"


def test_objects_of_another_release_are_not_mixed_in() -> None:
    services, pods, sets, deployments = release_objects(1, {})
    other = [{**p, "metadata": {**p["metadata"], "labels": {**p["metadata"]["labels"],
              "app.kubernetes.io/instance": "other"}}} for p in pods]  # fmt: skip
    (pipeline,) = group_pipelines(services, [*pods, *other], sets, deployments)
    assert len(pipeline.controllers) == 1 and len(pipeline.stage_pods) == 2


def test_each_stage_row_joins_its_shares_with_its_pod_and_node() -> None:
    (pipeline,) = group_pipelines(
        *release_objects(1, {"sarathi-cluster-p0-stage-1": running_ready(restarts=3)})
    )
    view = join(pipeline, pick_controller(pipeline.controllers), status_of(2), "")
    assert view.problems == []
    text = text_of(view)
    assert "sarathi-cluster/p0: smollm2-135m-instruct, serving" in text
    row1 = next(line for line in text.splitlines() if "sarathi-cluster-p0-stage-1" in line)
    for cell in ("node-a", "yes", " 3 ", "61.0", "29.0", "10.0", "42.1"):
        assert cell in row1, (cell, row1)
    stage = view.to_json()["stages"][1]
    assert stage["pod"]["name"] == "sarathi-cluster-p0-stage-1" and stage["pod"]["restarts"] == 3
    assert stage["utilizationPct"] == 61.0 and stage["bubblePct"] == 29.0


def test_a_pipeline_down_names_the_missing_pod_and_what_the_api_says() -> None:
    states = {
        "sarathi-cluster-p0-stage-0": crash_looping("OOMKilled", 137, restarts=7),
        "sarathi-cluster-p0-stage-1": None,  # never created
    }
    (pipeline,) = group_pipelines(*release_objects(1, states))
    status = status_of(2)
    status.serving, status.problem = False, "a pipeline stage is down (stage 0 rank 0 ...)"
    status.stages[0].up = False
    view = join(pipeline, pick_controller(pipeline.controllers), status, "")
    text = text_of(view)
    assert "NOT SERVING" in text and "0 DOWN" in text
    assert (
        "stage 0: pod sarathi-cluster-p0-stage-0: CrashLoopBackOff (last exit: OOMKilled, code "
        "137)" in text
    )
    assert "stage 1: pod sarathi-cluster-p0-stage-1: no such pod of StatefulSet" in text
    assert "controller: NOT SERVING: a pipeline stage is down" in text


def test_a_pending_pod_says_why_it_is_not_scheduled() -> None:
    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    pod = pods_of(
        [o for o in render("") if o["kind"] == "StatefulSet"],
        {"sarathi-cluster-p0-stage-1": pending_unschedulable(why)},
    )[1]
    view = view_of(pod)
    assert not view.ready and view.why == f"Pending: Unschedulable: {why}"


def test_an_unreachable_controller_is_said_and_rows_keep_their_pods() -> None:
    (pipeline,) = group_pipelines(*release_objects(1, {}))
    view = join(pipeline, pick_controller(pipeline.controllers), None, "no Status (refused)")
    text = text_of(view)
    assert "controller unreachable: no Status (refused)" in text
    assert "sarathi-cluster-p0-stage-0" in text and "NOT SERVING" in text


def test_the_ready_controller_is_asked_when_a_standby_is_not_ready() -> None:
    pods = pods_of([o for o in render("") if o["kind"] == "Deployment"], {})
    not_ready = {**running_ready(), "conditions": [{"type": "Ready", "status": "False"}]}
    standby = {
        **pods[0],
        "metadata": {**pods[0]["metadata"], "name": "standby"},
        "status": not_ready,
    }
    assert pick_controller([standby, pods[0]]) is pods[0]
