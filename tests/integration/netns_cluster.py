"""Cluster mode on namespace hosts, for tests: etcd and the controller on host `ctl`, the worker
of stage s on host `s<s>`, each started as its pod would be and, when supervised, restarted with
the same argv whenever it exits (Kubernetes' `restartPolicy: Always`).

Everything is stopped and every namespace removed when `namespaced_cluster` exits, whether the
tests passed or not.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sarathi_proto import generate_pb2, generate_pb2_grpc

from tests.integration.cluster_factories import make_tiny_served_model
from tests.integration.netns import TestNetwork, netns_unavailable_reason

SKIP_REASON = netns_unavailable_reason() or (
    None if shutil.which("etcd") else "no etcd server (apt-get install etcd-server)"
)

# The marks of every module that runs a namespace cluster.
NETNS_TEST_MARKS = [
    pytest.mark.integration,
    pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""),
]

GRPC_PORT = 50051
ETCD_PORT = 2379
CONTROL_PORT = 5555
# Restarted by the supervisor (when they are there); etcd is the cluster's service and is never
# restarted.
SUPERVISED = ("controller", "controller2", "s0", "s1")


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> float:
    """Polls predicate() until true; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what} not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


@dataclass
class NamespacedCluster:
    net: TestNetwork
    model_dir: Path
    logs: Path
    commands: dict[str, tuple[str, list[str]]]
    """name -> (host, argv): what each process is started (and restarted) with."""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)
    """Exited processes the supervisor leaves down for now."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _supervisor: threading.Thread | None = None
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    @property
    def addr(self) -> str:
        return f"{self.net.addresses['ctl']}:{GRPC_PORT}"

    @property
    def controller_addrs(self) -> str:
        """A gRPC target over every controller (the active one and any standby)."""
        hosts = [host for name, (host, _) in self.commands.items() if name.startswith("controller")]
        return "ipv4:" + ",".join(f"{self.net.addresses[h]}:{GRPC_PORT}" for h in hosts)

    # ---- processes --------------------------------------------------------------------------
    def start(self, name: str) -> subprocess.Popen[bytes]:
        host, argv = self.commands[name]
        with open(self.logs / f"{name}.log", "ab") as log:  # the child keeps its own handle
            proc = subprocess.Popen(self.net.command(host, argv), stdout=log, stderr=log)
        self.procs[name] = proc  # `ip netns exec` execs: proc.pid is the program itself
        return proc

    def kill(self, name: str) -> None:
        """kill -9; returns once the process is gone."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def supervise(self) -> None:
        """Restarts any supervised process that exits, unless it is held."""

        def loop() -> None:
            while not self._stop.wait(0.1):
                with self._lock:
                    for name in SUPERVISED:
                        proc = self.procs.get(name)
                        if name not in self.held and proc is not None and proc.poll() is not None:
                            self.restarts[name] = self.restarts.get(name, 0) + 1
                            self.start(name)

        self._supervisor = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._supervisor.start()

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """While inside, the supervisor does not restart `name` (a pod not yet rescheduled)."""
        with self._lock:
            self.held.add(name)
        try:
            yield
        finally:
            with self._lock:
                self.held.discard(name)

    def stop(self) -> None:
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        for channel in self._channels.values():
            channel.close()
        # Workers first, then the controllers, etcd last: each one's peers are still there.
        for group in (["s0", "s1"], ["controller", "controller2"], ["etcd"]):
            procs = [self.procs[n] for n in group if n in self.procs]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)

    # ---- clients ----------------------------------------------------------------------------
    def sarathictl(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """Runs sarathictl on the controller's host."""
        return subprocess.run(
            self.sarathictl_argv(*args), capture_output=True, text=True, timeout=timeout_s
        )

    def sarathictl_argv(self, *args: str) -> list[str]:
        return self.net.command("ctl", [sys.executable, "-m", "sarathictl.cli", *args])

    def channel_to(self, host: str) -> grpc.Channel:
        """A gRPC channel from this process to the API of the controller on `host`, through a
        Unix socket relayed into its namespace; it reconnects quickly after a restart."""
        if host not in self._channels:
            forward = self.net.forward(host, GRPC_PORT, self.logs / f"grpc-{host}.sock")
            self._channels[host] = grpc.insecure_channel(
                f"unix:{forward.path}",
                options=[
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 500),
                ],
            )
        return self._channels[host]

    @property
    def channel(self) -> grpc.Channel:
        """The channel to the controller on host `ctl`."""
        return self.channel_to("ctl")

    @property
    def stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(self.channel)

    def status(self, host: str = "ctl") -> generate_pb2.StatusResponse:
        stub = generate_pb2_grpc.GenerationStub(self.channel_to(host))
        return stub.Status(generate_pb2.StatusRequest(), timeout=5)

    def is_standby(self, host: str) -> bool:
        """The controller on host answers, as a standby."""
        try:
            return self.status(host).problem.startswith("standby")
        except grpc.RpcError:
            return False

    def healthy(self, host: str = "ctl") -> bool:
        """The controller on host serves requests (its API's health name: readiness)."""
        return self._health(host, "sarathi.v1.Generation")

    def alive(self, host: str = "ctl") -> bool:
        """The controller's process lives (the empty health name, which Kubernetes' startup and
        liveness probes ask): a standby too."""
        return self._health(host, "")

    def _health(self, host: str, name: str) -> bool:
        try:
            reply = health_pb2_grpc.HealthStub(self.channel_to(host)).Check(
                health_pb2.HealthCheckRequest(service=name), timeout=1
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def wait_for(self, predicate: Callable[[], object], timeout_s: float, what: str) -> float:
        """wait_until, with the processes' logs in the failure message."""
        try:
            return wait_until(predicate, timeout_s, what)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.log_tails()}") from None

    def log_tails(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.logs.glob("*.log"))
        )


@contextlib.contextmanager
def namespaced_cluster(
    tmp_path_factory: pytest.TempPathFactory,
    controller_flags: tuple[str, ...] = (),
    worker_flags: tuple[str, ...] = (),
    standby: bool = False,
) -> Iterator[NamespacedCluster]:
    """etcd, a pp=2 tp=1 controller and its two stage workers on hosts of their own, serving.
    standby: a second controller on host `ctl2`, started once the first serves (a standby)."""
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")
    logs = tmp_path_factory.mktemp("netns-logs")
    etcd_dir = tmp_path_factory.mktemp("etcd")
    controllers = {"controller": "ctl", "controller2": "ctl2"} if standby else {"controller": "ctl"}
    with TestNetwork([*controllers.values(), "s0", "s1"]) as net:
        ctl = net.addresses["ctl"]
        common = ["--model", str(model_dir), "--etcd", f"{ctl}:{ETCD_PORT}", "--cluster", "t"]
        commands = {
            "etcd": ("ctl", [
                "etcd", "--data-dir", str(etcd_dir / "data"),
                "--listen-client-urls", f"http://{ctl}:{ETCD_PORT}",
                "--advertise-client-urls", f"http://{ctl}:{ETCD_PORT}",
                "--listen-peer-urls", "http://127.0.0.1:2380",
            ]),
        }  # fmt: skip
        for name, host in controllers.items():
            address = net.addresses[host]
            commands[name] = (host, [
                sys.executable, "-m", "controller", *common, "--pp", "2", "--tp", "1",
                "--host", address, "--port", str(GRPC_PORT), "--advertise-host", address,
                "--control-addr", f"tcp://{address}:{CONTROL_PORT}", "--socket-ifname", "eth0",
                "--budget", "64", *controller_flags,
            ])  # fmt: skip
        for stage in (0, 1):
            host = f"s{stage}"
            commands[host] = (host, [
                sys.executable, "-m", "stage_worker", *common, "--stage", str(stage),
                "--tp-rank", "0", "--advertise-host", net.addresses[host], "--dtype", "float32",
                "--num-threads", "1", "--kv-cache-bytes", str(16 << 20), *worker_flags,
            ])  # fmt: skip
        cluster = NamespacedCluster(net, model_dir, logs, commands)
        try:
            for name in commands:
                if name != "controller2":
                    cluster.start(name)
            deadline = time.monotonic() + 180
            while True:
                run = cluster.sarathictl("status", "--addr", cluster.addr, "--json", timeout_s=30)
                if run.returncode == 0 and json.loads(run.stdout).get("scheduler"):
                    break
                for name, proc in cluster.procs.items():
                    assert proc.poll() is None, f"{name} exited:\n{cluster.log_tails()}"
                assert time.monotonic() < deadline, f"no cluster:\n{cluster.log_tails()}"
                time.sleep(1)
            if standby:
                cluster.start("controller2")
                cluster.wait_for(lambda: cluster.is_standby("ctl2"), 60, "a standby on ctl2")
            yield cluster
        finally:
            cluster.stop()
