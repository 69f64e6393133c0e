"""A Helm release's pipelines as the Kubernetes API shows them: per pipeline, its control Service,
its controller pods and its stage pods by stage, and how many stages there should be.

Found through the labels the chart sets (controller/chart_labels.py). The grouping is a pure
function of the API's JSON, so it is tested on the chart's own rendered objects.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller import chart_labels
from sarathictl.kube.connect import KubeApi

Obj = Mapping[str, Any]


@dataclass
class PipelineObjects:
    release: str
    index: int
    service: Obj
    """The pipeline's control Service (`<name>-p<i>-control`)."""
    controllers: list[Obj] = field(default_factory=list)
    stage_pods: dict[int, Obj] = field(default_factory=dict)
    stage_set: str = ""
    """The StatefulSet of its stage pods (pod `<stage_set>-<s>` serves stage s)."""
    num_stages: int = 0
    """Stages the StatefulSet asks for (at least as many as pods were found)."""
    controller_deployment: str = ""

    @property
    def name(self) -> str:
        return f"{self.release}/p{self.index}"


class ReleaseNotFound(ValueError):
    """Nothing of the chart where the command looked."""


def control_service_labels(release: str) -> dict[str, str]:
    return {**chart_labels.release_labels(release), chart_labels.SERVICE: "control"}


def find_pipelines(api: KubeApi, release: str = "") -> list[PipelineObjects]:
    """Every pipeline of the release (all releases of the chart when release is empty)."""
    labels = chart_labels.release_labels(release)
    services = _listed(api.core.list_namespaced_service, "Service", api.namespace, labels)
    pods = _listed(api.core.list_namespaced_pod, "Pod", api.namespace, labels)
    sets = _listed(api.apps.list_namespaced_stateful_set, "StatefulSet", api.namespace, labels)
    deployments = _listed(api.apps.list_namespaced_deployment, "Deployment", api.namespace, labels)
    pipelines = group_pipelines(services, pods, sets, deployments)
    if not pipelines:
        raise ReleaseNotFound(
            f"no sarathi-cluster release found in namespace {api.namespace!r} (API server "
            f"{api.server}): no Service labelled "
            f"{chart_labels.selector(control_service_labels(release))}"
            + _releases_seen(api, release)
        )
    return pipelines


def group_pipelines(
    services: Sequence[Obj], pods: Sequence[Obj], sets: Sequence[Obj], deployments: Sequence[Obj]
) -> list[PipelineObjects]:
    """Pipelines in (release, index) order from the chart's objects of one namespace."""
    found: dict[tuple[str, int], PipelineObjects] = {}
    for svc in services:
        index = chart_labels.pipeline_of(svc)
        if chart_labels.labels_of(svc).get(chart_labels.SERVICE) != "control" or index is None:
            continue
        release = chart_labels.labels_of(svc).get(chart_labels.INSTANCE, "")
        found[(release, index)] = PipelineObjects(release, index, svc)
    for obj in [*pods, *sets, *deployments]:
        release = chart_labels.labels_of(obj).get(chart_labels.INSTANCE, "")
        index = chart_labels.pipeline_of(obj)
        pipeline = None if index is None else found.get((release, index))
        if pipeline is not None:
            _place(pipeline, obj)
    for pipeline in found.values():
        pipeline.num_stages = max(pipeline.num_stages, len(pipeline.stage_pods))
    return [found[k] for k in sorted(found)]


def _place(pipeline: PipelineObjects, obj: Obj) -> None:
    component = chart_labels.labels_of(obj).get(chart_labels.COMPONENT)
    kind, name = obj.get("kind", ""), obj.get("metadata", {}).get("name", "")
    if kind == "StatefulSet" and component == "stage":
        pipeline.stage_set = name
        pipeline.num_stages = int(obj.get("spec", {}).get("replicas", 0) or 0)
    elif kind == "Deployment" and component == "controller":
        pipeline.controller_deployment = name
    elif kind == "Pod" and component == "controller":
        pipeline.controllers.append(obj)
    elif kind == "Pod" and component == "stage":
        stage = chart_labels.stage_of_pod(obj)
        if stage is not None:
            pipeline.stage_pods[stage] = obj


def _listed(list_call: Any, kind: str, namespace: str, labels: Mapping[str, str]) -> list[Obj]:
    """The objects a list call returns, each with its kind (list items carry none), keeping only
    those with the labels asked for (an API emulator may not filter)."""
    resp = list_call(
        namespace,
        label_selector=chart_labels.selector(labels),
        _preload_content=False,
        _request_timeout=10,
    )
    body = json.loads(resp.data)
    return [
        {**item, "kind": kind}
        for item in body.get("items") or []
        if chart_labels.matches(item, labels)
    ]


def _releases_seen(api: KubeApi, release: str) -> str:
    """Which releases of the chart the namespace does have, when one was asked for."""
    if not release:
        return ""
    labels = control_service_labels("")
    others = _listed(api.core.list_namespaced_service, "Service", api.namespace, labels)
    names = sorted({chart_labels.labels_of(s).get(chart_labels.INSTANCE, "") for s in others})
    return f"; releases in this namespace: {', '.join(names)}" if names else "; none at all"
