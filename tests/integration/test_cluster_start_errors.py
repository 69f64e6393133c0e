"""Cluster-mode start-up failures a user must be able to read: one clear line, non-zero exit."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.cluster_factories import make_tiny_served_model

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port  # closed again when the socket is: nothing listens there


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")


def test_controller_with_unreachable_etcd_exits_naming_it(model_dir: Path) -> None:
    etcd = f"127.0.0.1:{_closed_port()}"
    run = subprocess.run(
        [sys.executable, "-m", "controller", "--model", str(model_dir), "--port", "0",
         "--etcd", etcd, "--advertise-host", "127.0.0.1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert f"cannot reach etcd at {etcd}" in run.stderr


def test_worker_with_unreachable_etcd_exits_naming_it(model_dir: Path) -> None:
    etcd = f"127.0.0.1:{_closed_port()}"
    run = subprocess.run(
        [sys.executable, "-m", "stage_worker", "--model", str(model_dir), "--etcd", etcd,
         "--controller-wait", "30"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert "etcd" in run.stderr and etcd.split(":")[1] in run.stderr


def test_controller_refuses_cluster_mode_without_an_advertised_address(model_dir: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "controller", "--model", str(model_dir), "--etcd", "127.0.0.1:2379"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert "advertise_host" in run.stderr


def _controller(model_dir: Path, *flags: str) -> list[str]:
    control = f"tcp://127.0.0.1:{_closed_port()}"
    return [sys.executable, "-m", "controller", "--model", str(model_dir),
            "--control-addr", control, *flags]  # fmt: skip


def test_a_second_controller_on_a_port_in_use_is_refused(model_dir: Path) -> None:
    """gRPC's default SO_REUSEPORT let a second controller bind a port in use, and the kernel
    then shared the calls between the two clusters."""
    port = _closed_port()
    first = subprocess.Popen(_controller(model_dir, "--port", str(port)), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):
            assert first.poll() is None and time.monotonic() < deadline, "the first did not start"
            time.sleep(0.1)
        second = subprocess.run(
            _controller(model_dir, "--port", str(port)), capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 1
        last = second.stderr.strip().splitlines()[-1]
        assert (
            last == f"controller: cannot bind the gRPC API to 127.0.0.1:{port}: is the port in use?"
        )
        assert first.poll() is None
    finally:
        first.terminate()
        first.wait(30)


@pytest.mark.parametrize("flag", ["--http-port", "--metrics-port"])
def test_an_api_port_in_use_is_one_line(model_dir: Path, flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            _controller(model_dir, "--port", "0", flag, str(port)),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("controller: cannot bind") and f"127.0.0.1:{port}" in last, last
    assert "Traceback" not in run.stderr and "never awaited" not in run.stderr


def test_a_local_cluster_refuses_what_would_fail_before_spawning(model_dir: Path) -> None:
    """A depth or split the model cannot take, or a port in use, is refused at once rather than
    after every worker has loaded (the tiny model has 4 layers)."""
    from sarathictl.local_cluster import LocalCluster, LocalClusterConfig

    for config, error in (
        (
            LocalClusterConfig(str(model_dir), pp=5, port=0),
            "num_hidden_layers=4 is fewer than pp=5",
        ),
        (LocalClusterConfig(str(model_dir), pp=2, port=0, layer_split=(1, 1)), "--layer-split 1,1"),
    ):
        cluster = LocalCluster(config)
        with pytest.raises(ValueError, match=error):
            cluster.start()
        assert cluster.procs == []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for config, flag in (
            (LocalClusterConfig(str(model_dir), pp=1, port=port), "--port"),
            (LocalClusterConfig(str(model_dir), pp=1, port=0, http_port=port), "--http-port"),
        ):
            cluster = LocalCluster(config)
            with pytest.raises(ValueError, match=f"{flag} {port}: Address already in use"):
                cluster.start()
            assert cluster.procs == []
    # --host names an address this machine does not have (TEST-NET-3, RFC 5737), or none at all
    for host in ("203.0.113.7", "no-such-host.invalid"):
        cluster = LocalCluster(LocalClusterConfig(str(model_dir), pp=1, port=50999, host=host))
        with pytest.raises(ValueError, match=f"--host {host} is not an address of this machine"):
            cluster.start()
        assert cluster.procs == []


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_generate_with_no_cluster_says_so_within_seconds() -> None:
    """A stream that no controller ever answered gets two quick retries, not the eight of a
    stream cut mid-way (21 s of backoff before the one line that matters)."""
    addr = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "sarathictl.cli", "generate", "Hello", "--addr", addr],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1
    retries = [line for line in run.stderr.splitlines() if "(retry " in line]
    assert [line[line.index("(retry ") :] for line in retries] == [
        "(retry 1 of 2)",
        "(retry 2 of 2)",
    ]
    assert all(line.startswith("sarathictl: no answer yet (UNAVAILABLE") for line in retries)
    assert "stream cut" not in run.stderr
    assert f"sarathictl: cannot reach a controller at {addr}" in run.stderr
    assert time.monotonic() - started < 20
