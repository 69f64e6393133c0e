"""Careful file writing for model folders: free-space checks, atomic writes, clear disk errors.

Standard library only, so the fast path (a folder that is already complete) imports no torch.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sarathictl.model_prep.errors import ModelPrepError

# Mode of the written files; the umask still applies. safetensors alone would make weights 0600.
_FILE_MODE = 0o644


def ensure_free_space(directory: Path, needed_bytes: int, what: str) -> None:
    """Refuse early, with numbers, rather than fail half-way through a write."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free_bytes = shutil.disk_usage(probe).free
    if free_bytes < needed_bytes:
        raise ModelPrepError(
            f"not enough disk space for {what} in {directory}: need {needed_bytes >> 20} MiB, "
            f"{free_bytes >> 20} MiB free"
        )


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write` fills a file beside `path`, which is then renamed into place: a crash leaves
    either the old file or the new one, never half of one."""
    partial = path.with_name(path.name + ".partial")
    try:
        write(partial)
        umask = os.umask(0)
        os.umask(umask)
        partial.chmod(_FILE_MODE & ~umask)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def write_json_atomically(path: Path, value: Any) -> None:
    text = json.dumps(value, indent=2, ensure_ascii=False) + "\n"
    write_atomically(path, lambda partial: partial.write_text(text, encoding="utf-8"))


@contextmanager
def explained_os_errors(directory: Path) -> Iterator[None]:
    """A disk error during the writes becomes one line naming the folder."""
    try:
        yield
    except OSError as err:
        hint = " (disk full)" if err.errno == errno.ENOSPC else ""
        raise ModelPrepError(f"cannot write into {directory}{hint}: {err}") from err
