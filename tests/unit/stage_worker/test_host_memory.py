"""The memory a worker may still take (stage_worker/host_memory.py): Linux's MemAvailable,
within the limits of its cgroup v2 and those above it, and nothing where none can be read."""

from __future__ import annotations

from pathlib import Path

from stage_worker import host_memory

GIB = 1 << 30
MEMINFO = f"MemTotal: 24000000 kB\nMemFree: 1000 kB\nMemAvailable: {20 * GIB // 1024} kB\n"


def _host(tmp_path: Path, own: str, limits: dict[str, tuple[int, int, int] | None]) -> Path:
    """A fake /proc and /sys/fs/cgroup: limits by cgroup path, (max, current, inactive file)
    or None for "max"; the process in cgroup `own`."""
    (tmp_path / "meminfo").write_text(MEMINFO)
    (tmp_path / "self_cgroup").write_text(f"0::{own}\n")
    for path, limit in limits.items():
        d = tmp_path / "cg" / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text("max\n" if limit is None else f"{limit[0]}\n")
        (d / "memory.current").write_text(f"{0 if limit is None else limit[1]}\n")
        inactive = 0 if limit is None else limit[2]
        (d / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file 2\n")
    return tmp_path


def _available(root: Path) -> int | None:
    return host_memory.available_bytes(root / "meminfo", root / "cg", root / "self_cgroup")


def test_mem_available_where_no_cgroup_sets_a_limit(tmp_path: Path) -> None:
    root = _host(tmp_path, "/pod/worker", {"/": None, "/pod": None, "/pod/worker": None})
    assert _available(root) == 20 * GIB


def test_the_tightest_cgroup_above_the_process_bounds_it(tmp_path: Path) -> None:
    # the pod's limit (16 GiB, 10 held, 1 of it inactive file pages) is the tightest
    limits = {"/": None, "/pod": (16 * GIB, 10 * GIB, GIB), "/pod/worker": (30 * GIB, 0, 0)}
    assert _available(_host(tmp_path, "/pod/worker", limits)) == 7 * GIB


def test_in_a_cgroup_namespace_the_root_is_the_own_cgroup(tmp_path: Path) -> None:
    root = _host(tmp_path, "/", {"/": (8 * GIB, 2 * GIB, 0)})
    assert _available(root) == 6 * GIB


def test_nothing_readable_is_none(tmp_path: Path) -> None:
    assert (
        host_memory.available_bytes(tmp_path / "meminfo", tmp_path / "cg", tmp_path / "self_cgroup")
        is None
    )
    (tmp_path / "meminfo").write_text("MemTotal: 1 kB\n")  # no MemAvailable line (old kernels)
    assert (
        host_memory.available_bytes(tmp_path / "meminfo", tmp_path / "cg", tmp_path / "self_cgroup")
        is None
    )


def test_a_cgroup_v1_memory_limit_bounds_it_too(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text(MEMINFO)
    (tmp_path / "self_cgroup").write_text("4:memory:/job/7\n0::/\n")
    job = tmp_path / "cg" / "memory" / "job"
    (job / "7").mkdir(parents=True)
    for d, limit in ((tmp_path / "cg" / "memory", 1 << 63), (job, 12 * GIB), (job / "7", 1 << 63)):
        (d / "memory.limit_in_bytes").write_text(f"{limit - (limit % 4096)}\n")
        (d / "memory.usage_in_bytes").write_text(f"{5 * GIB}\n")
        (d / "memory.stat").write_text(f"cache 3\ntotal_inactive_file {GIB}\n")
    assert _available(tmp_path) == 8 * GIB  # the job's 12 GiB, 5 used, 1 of it reclaimable
