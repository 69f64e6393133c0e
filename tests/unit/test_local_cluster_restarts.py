"""`up --local` restarts children that exit, and gives up only on a crash loop: one child's
max_restarts in a row, each within restart_window_s of the one before, not in the cluster's
whole life, and not the restarts of every worker that a lost stage makes."""

from __future__ import annotations

from pathlib import Path

import pytest
from sarathictl import local_cluster
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig


class ExitedProcess:
    def poll(self) -> int:
        return 1


def cluster_with_a_dying_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalCluster:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "worker.log").write_text("it died\n")
    config = LocalClusterConfig(str(tmp_path), pp=1, max_restarts=3, restart_window_s=60.0)
    cluster = LocalCluster(config, log_dir=tmp_path)
    cluster._commands["worker"] = ([], {})

    def spawn(name: str, args: list[str], env: dict[str, str]) -> None:
        cluster.procs.append((name, ExitedProcess()))  # type: ignore[arg-type]

    monkeypatch.setattr(cluster, "_spawn", spawn)
    cluster.procs.append(("worker", ExitedProcess()))  # type: ignore[arg-type]
    return cluster


def test_a_quiet_window_starts_the_count_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = cluster_with_a_dying_worker(tmp_path, monkeypatch)
    now = [1000.0]
    monkeypatch.setattr(local_cluster.time, "monotonic", lambda: now[0])
    for _ in range(10):  # a crash every 61 s: ten in all, each after a quiet window
        assert cluster.supervise() == ["worker"]
        now[0] += 61.0
    assert cluster.num_restarts == 10
    for _ in range(3):  # then one every 30 s, a loop slower than a model's load: it ends
        assert cluster.supervise() == ["worker"]
        now[0] += 30.0
    with pytest.raises(RuntimeError, match="worker exited with code 1; its log ends:\nit died"):
        cluster.supervise()


def test_every_worker_leaving_a_broken_pipeline_counts_once_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost stage restarts every worker: a rebuild. With eight workers and a budget of three,
    three rebuilds in a row are within it, a fourth is not."""
    cluster = cluster_with_a_dying_worker(tmp_path, monkeypatch)
    names = [f"stage{s}-rank{r}" for s in range(4) for r in range(2)]
    for name in names:
        cluster._commands[name] = ([], {})
        (tmp_path / f"{name}.log").write_text("the pipeline broke\n")
    cluster.procs = [(name, ExitedProcess()) for name in names]  # type: ignore[misc]
    now = [1000.0]
    monkeypatch.setattr(local_cluster.time, "monotonic", lambda: now[0])
    for _ in range(3):
        assert cluster.supervise() == names
        now[0] += 5.0
    assert cluster.num_restarts == 24
    with pytest.raises(RuntimeError, match="stage0-rank0 exited with code 1"):
        cluster.supervise()


def test_a_child_killed_says_how_and_a_sigkill_points_at_memory() -> None:
    exit_reason = local_cluster.exit_reason
    assert exit_reason(1) == "exited with code 1"
    assert exit_reason(-4) == "was killed by signal SIGILL"
    assert "out-of-memory killer" in exit_reason(-9) and "--kv-cache-mb" in exit_reason(-9)
