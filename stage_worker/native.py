"""Builds and loads the worker's C kernels (the CPU fast paths), on first use.

Each kernel is one C file compiled with the system's C compiler into a per-user cache, named by
a hash of its source and flags, so an edited kernel is rebuilt and workers starting together
share one build (well under a second). A kernel that cannot run here (another architecture, a
CPU without the instructions, no compiler) loads as None with the reason logged, and its caller
keeps the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sarathi-cluster" / "kernels"


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _build(source: Path, flags: tuple[str, ...], out: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compiled beside its final name and renamed: workers starting together never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        result = subprocess.run(
            [compiler, *flags, "-shared", "-fPIC", str(source), "-o", str(built)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, out)


def load(
    source: Path, symbol: str, flags: tuple[str, ...], needs: tuple[str, ...]
) -> ctypes._NamedFuncPointer | None:
    """The function `symbol` of the C file `source` compiled with `flags`, or None (reason
    logged) where the CPU lacks one of the `needs` flags or the build fails."""
    missing = [flag for flag in needs if flag not in cpu_flags()]
    if missing:
        logger.info("%s: this CPU lacks %s; the torch path runs instead", symbol, missing[0])
        return None
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"{source.stem}-{digest}.so"
    try:
        if not lib_path.exists():
            _build(source, flags, lib_path)
        fn = getattr(ctypes.CDLL(str(lib_path)), symbol)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
        logger.warning("%s unavailable (%s); the torch path runs instead", symbol, err)
        return None
    logger.info("%s loaded from %s", symbol, lib_path)
    return fn
