"""Cluster mode over real links: etcd, the controller and each pipeline stage on hosts of their
own (network namespaces joined through a bridge), as `helm install` lays them out on nodes."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller.tokenizer import Tokenizer
from tests.integration.cluster_factories import make_tiny_served_model, oracle_greedy
from tests.integration.netns import TestNetwork, netns_unavailable_reason

_SKIP = netns_unavailable_reason() or (
    None if shutil.which("etcd") else "no etcd server (apt-get install etcd-server)"
)
pytestmark = [pytest.mark.integration, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

GRPC_PORT = 50051
ETCD_PORT = 2379


@dataclass
class NamespacedCluster:
    net: TestNetwork
    model_dir: Path
    procs: dict[str, subprocess.Popen[bytes]]
    logs: Path

    @property
    def addr(self) -> str:
        return f"{self.net.addresses['ctl']}:{GRPC_PORT}"

    def sarathictl(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """Runs sarathictl on the controller's host."""
        argv = self.net.command("ctl", [sys.executable, "-m", "sarathictl.cli", *args])
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)

    def log_tails(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
            for p in self.logs.glob("*.log")
        )


def _start(
    net: TestNetwork, host: str, name: str, argv: list[str], logs: Path
) -> subprocess.Popen[bytes]:
    log = open(logs / f"{name}.log", "wb")  # noqa: SIM115 (owned by the child)
    proc = subprocess.Popen(net.command(host, argv), stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NamespacedCluster]:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")
    logs = tmp_path_factory.mktemp("netns-logs")
    etcd_dir = tmp_path_factory.mktemp("etcd")
    with TestNetwork(["ctl", "s0", "s1"]) as net:
        ctl, s0, s1 = (net.addresses[h] for h in ("ctl", "s0", "s1"))
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            procs["etcd"] = _start(net, "ctl", "etcd", [
                "etcd", "--data-dir", str(etcd_dir / "data"),
                "--listen-client-urls", f"http://{ctl}:{ETCD_PORT}",
                "--advertise-client-urls", f"http://{ctl}:{ETCD_PORT}",
                "--listen-peer-urls", "http://127.0.0.1:2380",
            ], logs)  # fmt: skip
            common = ["--model", str(model_dir), "--etcd", f"{ctl}:{ETCD_PORT}", "--cluster", "t"]
            procs["controller"] = _start(net, "ctl", "controller", [
                sys.executable, "-m", "controller", *common, "--pp", "2", "--tp", "1",
                "--host", ctl, "--port", str(GRPC_PORT), "--advertise-host", ctl,
                "--control-addr", f"tcp://{ctl}:5555", "--socket-ifname", "eth0", "--budget", "64",
            ], logs)  # fmt: skip
            for stage, (host, address) in enumerate((("s0", s0), ("s1", s1))):
                procs[host] = _start(net, host, host, [
                    sys.executable, "-m", "stage_worker", *common, "--stage", str(stage),
                    "--tp-rank", "0", "--advertise-host", address, "--dtype", "float32",
                    "--num-threads", "1", "--kv-cache-bytes", str(16 << 20),
                ], logs)  # fmt: skip
            result = NamespacedCluster(net, model_dir, procs, logs)
            deadline = time.monotonic() + 180
            while True:
                status = result.sarathictl("status", "--addr", result.addr, "--json", timeout_s=30)
                if status.returncode == 0 and json.loads(status.stdout).get("scheduler"):
                    break
                for name, proc in procs.items():
                    assert proc.poll() is None, f"{name} exited:\n{result.log_tails()}"
                assert time.monotonic() < deadline, f"no cluster:\n{result.log_tails()}"
                time.sleep(1)
            yield result
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def test_generation_over_the_namespaced_cluster_matches_the_oracle(
    cluster: NamespacedCluster,
) -> None:
    prompt = "The capital of France"
    run = cluster.sarathictl(
        "generate", prompt, "--addr", cluster.addr, "--max-tokens", "10", "--ignore-eos", "--json"
    )
    assert run.returncode == 0, run.stderr + cluster.log_tails()
    tokens = json.loads(run.stdout)["token_ids"]
    prompt_ids = Tokenizer.from_dir(cluster.model_dir).encode(prompt)
    assert tokens == oracle_greedy(cluster.model_dir, prompt_ids, 10)


def test_status_shows_each_stage_on_its_own_host(cluster: NamespacedCluster) -> None:
    run = cluster.sarathictl("status", "--addr", cluster.addr, "--json")
    assert run.returncode == 0, run.stderr
    stages = json.loads(run.stdout)["stages"]
    hosts = [s["host"] for s in stages]
    assert hosts == [cluster.net.addresses["s0"], cluster.net.addresses["s1"]]
    table = cluster.sarathictl("status", "--addr", cluster.addr).stdout
    assert cluster.net.addresses["s1"] in table


def test_a_second_worker_for_a_taken_place_is_refused(cluster: NamespacedCluster) -> None:
    late = subprocess.run(
        cluster.net.command("s1", [
            sys.executable, "-m", "stage_worker", "--model", str(cluster.model_dir),
            "--etcd", f"{cluster.net.addresses['ctl']}:{ETCD_PORT}", "--cluster", "t",
            "--stage", "1", "--tp-rank", "0", "--dtype", "float32",
        ]),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert late.returncode != 0
    assert "stage 1 rank 0" in late.stdout + late.stderr
