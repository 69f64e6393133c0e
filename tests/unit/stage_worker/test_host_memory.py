"""The memory a worker may still take (stage_worker/host_memory.py): Linux's MemAvailable,
within a cgroup v2 limit where one is set, and nothing where neither can be read."""

from __future__ import annotations

from pathlib import Path

from stage_worker import host_memory

MEMINFO = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n"


def _files(tmp_path: Path, meminfo: str | None, limit: str | None, current: int = 0) -> Path:
    if meminfo is not None:
        (tmp_path / "meminfo").write_text(meminfo)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    if limit is not None:
        (cgroup / "memory.max").write_text(limit + "\n")
        (cgroup / "memory.current").write_text(f"{current}\n")
    return cgroup


def test_mem_available_without_a_cgroup_limit(tmp_path: Path) -> None:
    for limit in (None, "max"):  # no cgroup v2 files; a cgroup without a limit
        root = tmp_path / f"case-{limit}"
        root.mkdir()
        cgroup = _files(root, MEMINFO, limit)
        got = host_memory.available_bytes(root / "meminfo", cgroup)
        assert got == 20000000 * 1024


def test_a_pod_limit_below_mem_available_is_what_is_left(tmp_path: Path) -> None:
    cgroup = _files(tmp_path, MEMINFO, str(16 << 30), current=10 << 30)
    assert host_memory.available_bytes(tmp_path / "meminfo", cgroup) == 6 << 30


def test_nothing_readable_is_none(tmp_path: Path) -> None:
    cgroup = _files(tmp_path, None, None)
    assert host_memory.available_bytes(tmp_path / "meminfo", cgroup) is None
    (tmp_path / "meminfo").write_text("MemTotal: 1 kB\n")  # no MemAvailable line (old kernels)
    assert host_memory.available_bytes(tmp_path / "meminfo", cgroup) is None
