"""How much memory this process may still take on the host: what Linux says is available,
within the cgroup's limit where one is set (a Kubernetes pod's `resources.limits.memory`),
which the kernel's MemAvailable does not see."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def available_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    """Bytes this process may still allocate, or None where neither source can be read."""
    found = [b for b in (_mem_available(meminfo), _cgroup_room(cgroup)) if b is not None]
    return min(found) if found else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # "MemAvailable:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(cgroup: Path) -> int | None:
    """cgroup v2: memory.max less memory.current; None without a limit ("max") or a cgroup."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((cgroup / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None
