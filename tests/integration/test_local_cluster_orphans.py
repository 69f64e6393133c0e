"""A local cluster's children end with the process that started them, even when it is killed
with SIGKILL (no stop() runs): no orphaned workers holding ports and memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from sarathictl.local_cluster import _die_with_parent_prefix

pytestmark = pytest.mark.integration

SPAWN_A_CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    from sarathictl.local_cluster import _die_with_parent_prefix
    child = subprocess.Popen([*_die_with_parent_prefix(), sys.executable, "-c",
                              "import time; time.sleep(120)"])
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_child_ends_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", SPAWN_A_CHILD], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert _alive(child_pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid), "the child outlived its killed parent"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_child_whose_parent_died_before_it_started_does_not_run(tmp_path: Path) -> None:
    """The window before setpriv sets the signal: a child that finds another parent than the one
    that spawned it exits without running its command (here: told to expect pid 1)."""
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()"
    done = subprocess.run(
        [*_die_with_parent_prefix(parent_pid=1), sys.executable, "-c", code], timeout=30
    )
    assert done.returncode != 0
    assert not marker.exists(), "the command ran under a parent that was not its spawner"
    # The same prefix with the real parent runs it.
    subprocess.run([*_die_with_parent_prefix(), sys.executable, "-c", code], timeout=30, check=True)
    assert marker.exists()
