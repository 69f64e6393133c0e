"""How much memory this process may still take on the host: what Linux says is available,
within the limits of its cgroup and the cgroups above it where set (a Kubernetes pod's
`resources.limits.memory`, a systemd MemoryMax), which the kernel's MemAvailable does not see:
cgroup v2, and v1's memory controller where a host still mounts it."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def available_bytes(
    meminfo: Path = MEMINFO, cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP
) -> int | None:
    """Bytes this process may still allocate, or None where nothing can be read."""
    found = [_mem_available(meminfo)]
    found += [_cgroup_room(d) for d in _cgroup_dirs(cgroup_root, self_cgroup)]
    found += [_cgroup_v1_room(d) for d in _cgroup_v1_dirs(cgroup_root, self_cgroup)]
    known = [b for b in found if b is not None]
    return min(known) if known else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # "MemAvailable:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_dirs(root: Path, self_cgroup: Path) -> list[Path]:
    """This process's cgroup v2 directory and those above it, up to root ("0::/a/b" in
    /proc/self/cgroup; inside a cgroup namespace the path is "/", the root itself)."""
    try:
        line = next(ln for ln in self_cgroup.read_text().splitlines() if ln.startswith("0::"))
    except (OSError, StopIteration):
        return [root]
    own = root / line[3:].strip().lstrip("/")
    return [own, *own.parents[: len(own.relative_to(root).parts)]]


def _cgroup_room(cgroup: Path) -> int | None:
    """memory.max less what the cgroup holds that it cannot drop (memory.current less its
    inactive file pages, which the kernel reclaims first); None without a limit ("max")."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        current = int((cgroup / "memory.current").read_text().strip())
        return max(0, int(limit) - current + _inactive_file(cgroup))
    except (OSError, ValueError):
        return None


def _inactive_file(cgroup: Path) -> int:
    try:
        for line in (cgroup / "memory.stat").read_text().splitlines():
            if line.startswith("inactive_file "):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return 0


V1_UNLIMITED = 1 << 62
"""cgroup v1 writes "no limit" as a page-rounded 2^63 - 1."""


def _cgroup_v1_dirs(root: Path, self_cgroup: Path) -> list[Path]:
    """This process's v1 memory cgroup and those above it ("4:memory:/a/b"), where mounted;
    where the path is not under the mount (a container sees its own cgroup as the root), the
    mount's root alone."""
    mount = root / "memory"
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if "memory" in controllers.split(","):
            own = mount / path.strip().lstrip("/")
            if not own.is_dir():
                return [mount] if mount.is_dir() else []
            return [own, *own.parents[: len(own.relative_to(mount).parts)]]
    return []


def _cgroup_v1_room(cgroup: Path) -> int | None:
    """memory.limit_in_bytes less memory.usage_in_bytes, its inactive file pages added back;
    None without a limit."""
    try:
        limit = int((cgroup / "memory.limit_in_bytes").read_text().strip())
        if limit >= V1_UNLIMITED:
            return None
        usage = int((cgroup / "memory.usage_in_bytes").read_text().strip())
        inactive = 0
        for line in (cgroup / "memory.stat").read_text().splitlines():
            if line.startswith("total_inactive_file "):
                inactive = int(line.split()[1])
        return max(0, limit - usage + inactive)
    except (OSError, ValueError, IndexError):
        return None
