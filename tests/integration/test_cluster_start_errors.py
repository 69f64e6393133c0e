"""Cluster-mode start-up failures a user must be able to read: one clear line, non-zero exit."""

from __future__ import annotations

import socket
import subprocess
import sys
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
