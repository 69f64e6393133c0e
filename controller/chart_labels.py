"""The labels the Helm chart (deploy/helm/sarathi-cluster) puts on its pods and Services, and what
they say: which release, which pipeline, controller or stage, and which stage a stage pod serves.

One place for this knowledge: the controller's Kubernetes events find their stage pods with it, and
`sarathictl status --kubernetes` finds a release's pipelines with it. Plain dicts of the API's JSON
in, no Kubernetes client needed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
PIPELINE = "sarathi-cluster/pipeline"
SERVICE = "sarathi-cluster/service"
POD_INDEX = "apps.kubernetes.io/pod-index"
"""Set by the StatefulSet controller since Kubernetes 1.28; the chart's pod ordinal is the stage."""
CHART_NAME = "sarathi-cluster"

_ORDINAL = re.compile(r"-(\d+)$")

Obj = Mapping[str, Any]


def labels_of(obj: Obj) -> Mapping[str, str]:
    labels: Mapping[str, str] = obj.get("metadata", {}).get("labels") or {}
    return labels


def selector(labels: Mapping[str, str]) -> str:
    """The API's label selector (`k=v,k=v`) for exactly these labels."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def matches(obj: Obj, labels: Mapping[str, str]) -> bool:
    """True when obj carries every one of these labels (what the selector asked the API for)."""
    have = labels_of(obj)
    return all(have.get(k) == v for k, v in labels.items())


def release_labels(release: str = "") -> dict[str, str]:
    """Every object of the chart's releases, or of one release."""
    return {NAME: CHART_NAME, **({INSTANCE: release} if release else {})}


def stage_pod_labels(of_pod: Obj) -> dict[str, str]:
    """The stage pods of the pipeline a pod of the chart (its controller) belongs to."""
    have = labels_of(of_pod)
    return {
        NAME: have.get(NAME, CHART_NAME),
        INSTANCE: have.get(INSTANCE, ""),
        COMPONENT: "stage",
        PIPELINE: have.get(PIPELINE, ""),
    }


def stage_of_pod(pod: Obj) -> int | None:
    """The pipeline stage a stage pod serves: its StatefulSet ordinal (pod-index label, or the
    number its name ends with); None for a pod that has neither."""
    index = labels_of(pod).get(POD_INDEX, "")
    if index.isdigit():
        return int(index)
    found = _ORDINAL.search(pod.get("metadata", {}).get("name", ""))
    return int(found.group(1)) if found else None


def pipeline_of(obj: Obj) -> int | None:
    value = labels_of(obj).get(PIPELINE, "")
    return int(value) if value.isdigit() else None
