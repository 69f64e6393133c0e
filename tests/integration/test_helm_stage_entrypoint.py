"""The stage pods' entry point (deploy/helm/sarathi-cluster/files/stage-pod.sh), run for real with a
fake `python` standing in for the workers: one worker per TP rank with the right stage, rank and
device; the pod ends, with the worker's status, as soon as any worker ends; SIGTERM reaches all."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "deploy/helm/sarathi-cluster/files/stage-pod.sh"

# Logs its arguments, then waits; logs the SIGTERM it gets from the entry point (the trap set
# before the start is logged, so a SIGTERM sent upon it is logged too). Rank $FAIL_RANK exits
# with $FAIL_STATUS once every rank has started, however slowly the machine starts them.
FAKE_PYTHON = """#!/bin/bash
rank=x
for ((i = 1; i <= $#; i++)); do
  if [[ "${!i}" == --tp-rank ]]; then j=$((i + 1)); rank="${!j}"; fi
done
trap 'echo "term $rank" >> "$FAKE_LOG"; exit 0' TERM
echo "start $rank $*" >> "$FAKE_LOG"
if [[ "$rank" == "${FAIL_RANK:-none}" ]]; then
  while (( $(grep -c '^start' "$FAKE_LOG") < SARATHI_TP )); do sleep 0.02; done
  exit "${FAIL_STATUS:-3}"
fi
while true; do sleep 0.05; done
"""


def start_pod(tmp_path: Path, tp: int, device: str = "cuda", **env: str) -> subprocess.Popen[str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    full_env = {
        **os.environ,
        "SARATHI_TP": str(tp),
        "SARATHI_DEVICE": device,
        "SARATHI_PYTHON": str(fake),
        "HOSTNAME": "sarathi-cluster-p0-stage-5",
        "FAKE_LOG": str(tmp_path / "log"),
        **env,
    }
    return subprocess.Popen(
        ["/bin/bash", str(SCRIPT), "--model=/models/m", "--controller=tcp://c:5555"],
        env=full_env,
        stderr=subprocess.PIPE,
        text=True,
    )


def log_lines(tmp_path: Path, prefix: str) -> list[str]:
    path = tmp_path / "log"
    lines = path.read_text().splitlines() if path.exists() else []
    return sorted(line for line in lines if line.startswith(prefix))


def wait_for_starts(tmp_path: Path, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(log_lines(tmp_path, "start")) < count:
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.02)


def test_one_worker_per_gpu_and_the_pod_ends_when_one_worker_ends(tmp_path: Path) -> None:
    pod = start_pod(tmp_path, tp=4, FAIL_RANK="2", FAIL_STATUS="7")
    _, stderr = pod.communicate(timeout=20)
    assert pod.returncode == 7, stderr
    starts = log_lines(tmp_path, "start")
    assert len(starts) == 4
    for rank, line in enumerate(starts):
        assert line.startswith(
            f"start {rank} -m stage_worker --model=/models/m --controller=tcp://c:"
        )
        assert line.endswith(f"--stage 5 --tp-rank {rank} --device cuda:{rank}")
    # The other three were stopped, not left running without their TP peer.
    assert log_lines(tmp_path, "term") == ["term 0", "term 1", "term 3"]
    assert "a worker exited with status 7" in stderr


def test_sigterm_stops_every_worker(tmp_path: Path) -> None:
    pod = start_pod(tmp_path, tp=2, device="cpu")
    wait_for_starts(tmp_path, 2)
    pod.send_signal(signal.SIGTERM)
    pod.communicate(timeout=10)
    assert pod.returncode != 0  # ended by a signal
    assert log_lines(tmp_path, "term") == ["term 0", "term 1"]
    assert all(line.endswith("--device cpu") for line in log_lines(tmp_path, "start"))


def test_explicit_stage_overrides_the_hostname(tmp_path: Path) -> None:
    pod = start_pod(tmp_path, tp=1, SARATHI_STAGE="1", FAIL_RANK="0", FAIL_STATUS="0")
    pod.communicate(timeout=10)
    assert pod.returncode == 0
    assert log_lines(tmp_path, "start")[0].endswith("--stage 1 --tp-rank 0 --device cuda:0")


@pytest.mark.parametrize(("env", "message"), [
    ({"SARATHI_TP": "0"}, "SARATHI_TP=0 is not a positive integer"),
    ({"HOSTNAME": "no-ordinal-here"}, "stage 'here' is not a number"),
])  # fmt: skip
def test_bad_environment_is_refused_before_starting_workers(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    pod = start_pod(tmp_path, tp=2, **env)
    _, stderr = pod.communicate(timeout=10)
    assert pod.returncode == 2
    assert message in stderr
    assert log_lines(tmp_path, "start") == []
