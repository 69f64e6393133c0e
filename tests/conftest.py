"""Session-wide guard: the project never reads files beside its checkout.

A user's clone has nothing next to it, while a developer's or CI's may (a `../shared` folder with
design material). Code that quietly read from there would pass here and fail for every user, so an
audit hook records every file opened under the checkout's parent folder but outside the checkout,
and the session fails if there was one. Temporary folders, the interpreter and its packages stay
allowed wherever they live. Child processes are covered by the static scan in
tests/unit/test_self_contained.py.
"""

from __future__ import annotations

import os
import site
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


_NEIGHBOURHOOD = str(REPO_ROOT.parent) + os.sep


def _allowed_prefixes() -> tuple[str, ...]:
    roots = {
        REPO_ROOT,
        Path(tempfile.gettempdir()),
        Path(sys.prefix),
        Path(sys.base_prefix),
        Path(sys.exec_prefix),
        Path.home(),
        *(Path(p) for p in site.getsitepackages()),
    }
    prefixes = (str(p.resolve()) + os.sep for p in roots)
    # A root that holds the whole neighbourhood (a checkout right in $HOME) would allow everything.
    return tuple(p for p in prefixes if not _NEIGHBOURHOOD.startswith(p) or p == _REPO_PREFIX)


_REPO_PREFIX = str(REPO_ROOT) + os.sep
_ALLOWED = _allowed_prefixes()
outside_reads: list[str] = []


def is_outside_the_repository(path: str) -> bool:
    """True for a file beside the checkout: under its parent, not in it, not a tool's dot-folder
    (a checkout in $HOME has ~/.cache beside it), not a temporary folder or the interpreter."""
    path = os.path.abspath(path)
    if not path.startswith(_NEIGHBOURHOOD) or path.startswith(_ALLOWED):
        return False
    return not path[len(_NEIGHBOURHOOD) :].startswith(".")


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event != "open" or not args or not isinstance(args[0], (str, os.PathLike)):
        return
    path = os.fspath(args[0])
    if isinstance(path, str) and is_outside_the_repository(path):
        outside_reads.append(path)


# `up --local` runs the layout `sarathictl tune-layout` measured on this machine, if any: the
# tests (and the processes they start, which inherit this) see only the layouts they write.
# The file is never written: a test that measures passes its own --layout-file.
os.environ["SARATHI_LAYOUT_FILE"] = os.path.join(
    tempfile.gettempdir(), f"sarathi-test-layouts-{os.getpid()}.json"
)

# A checkout at the file system's root has no folder of its own to guard.
if REPO_ROOT.parent != Path(REPO_ROOT.anchor):
    sys.addaudithook(_audit)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if outside_reads:
        shown = "\n  ".join(sorted(set(outside_reads))[:10])
        sys.stderr.write(
            f"\nThe tests opened files outside the repository ({REPO_ROOT}); a user's clone has "
            f"nothing beside it:\n  {shown}\n"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_checkpoint(arch) -> folder with config.json + model.safetensors of a tiny random
    model (tests/unit/stage_worker/tiny_models.py), written once per architecture per session."""
    from tests.unit.stage_worker.tiny_models import make_checkpoint

    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_checkpoint(arch, tmp_path_factory.mktemp(arch))
        return made[arch]

    return get
