"""The chart grants the controllers exactly the Kubernetes API access their events need: create
events and read pods, in the release's namespace, through a ServiceAccount of their own; and
nothing (no token mounted) when events are turned off."""

from __future__ import annotations

from typing import Any

from tests.unit.test_helm_chart import of_kind, only, render

NAME = "sarathi-cluster-controller"


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def controllers(objs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [d for d in of_kind(objs, "Deployment") if d["metadata"]["name"].endswith("-controller")]


def test_controllers_may_create_events_and_read_pods_in_their_namespace_only() -> None:
    objs = render("", "pipelines=2")
    role = only(objs, "Role", NAME)
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}  # fmt: skip
    assert rules == {("", "events"): {"create"}, ("", "pods"): {"get", "list"}}
    binding = only(objs, "RoleBinding", NAME)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": NAME}  # fmt: skip
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME,
                                    "namespace": "default"}]  # fmt: skip
    only(objs, "ServiceAccount", NAME)
    assert not of_kind(objs, "ClusterRole") and not of_kind(objs, "ClusterRoleBinding")
    for deployment in controllers(objs):
        spec = pod_spec(deployment)
        assert spec["serviceAccountName"] == NAME and spec["automountServiceAccountToken"]
        env = {e["name"]: e.get("valueFrom", {}) for e in spec["containers"][0]["env"]}
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_stage_pods_get_no_token() -> None:
    for sts in of_kind(render(""), "StatefulSet"):
        assert pod_spec(sts)["automountServiceAccountToken"] is False


def test_events_off_grants_nothing_and_mounts_no_token() -> None:
    objs = render("", "controller.events.enabled=false")
    assert not [o for o in objs if o["metadata"]["name"] == NAME]
    for deployment in controllers(objs):
        spec = pod_spec(deployment)
        assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
        assert "POD_NAME" not in {e["name"] for e in spec["containers"][0]["env"]}
