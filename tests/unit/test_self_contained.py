"""The repository is self-contained: nothing in it reads a path beside the checkout.

Two guards: tests/conftest.py records every file the test session opens beside the checkout (and
fails the session), and this file scans every tracked source file for paths that climb out of the
repository, which also covers the processes the integration tests start.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, is_outside_the_repository

SOURCE_SUFFIXES = {".py", ".sh", ".toml", ".cfg", ".yaml", ".yml", ".tpl", ".txt", ".Dockerfile"}
SOURCE_NAMES = {"Makefile", "run"}
# The guards themselves name the patterns they look for.
GUARDS = {Path("tests/conftest.py"), Path("tests/unit/test_self_contained.py")}
# `../shared`, `..\\shared` or `os.pardir` next to `shared`: the design folder beside a checkout.
_SIBLING = re.compile(r"\.\.[/\\]+shared|pardir\W+shared")
# Path(__file__)...parents[k] with any .parent after it; or Path(__file__) followed by .parent's.
_PARENTS_INDEX = re.compile(r"__file__.*?parents\[(\d+)\]((?:\.parent)*)")
_PARENT_CHAIN = re.compile(r"__file__[^\n]*?((?:\.parent)+)")


def tracked_sources() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    paths = [Path(line) for line in out.stdout.splitlines() if Path(line) not in GUARDS]
    return [REPO_ROOT / p for p in paths if p.suffix in SOURCE_SUFFIXES or p.name in SOURCE_NAMES]


def levels_above(line: str) -> int | None:
    """How many folders above a file's own folder a `__file__` expression climbs, if it does."""
    if match := _PARENTS_INDEX.search(line):
        return int(match.group(1)) + match.group(2).count(".parent")
    if match := _PARENT_CHAIN.search(line):
        return match.group(1).count(".parent") - 1
    return None


def escapes(path: Path) -> list[str]:
    """Lines of `path` that reach beside the repository."""
    depth = len(path.relative_to(REPO_ROOT).parts) - 1  # parents[depth] is the repository root
    found = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        climbed = levels_above(line)
        if _SIBLING.search(line) or (climbed is not None and climbed > depth):
            found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    return found


def test_no_tracked_source_reaches_beside_the_repository() -> None:
    sources = tracked_sources()
    assert len(sources) > 100  # the scan saw the tree, not an empty listing
    found = [hit for path in sources for hit in escapes(path)]
    assert found == [], "code reaches outside the repository:\n" + "\n".join(found)


def test_the_scan_catches_what_the_old_trace_loader_did() -> None:
    workloads = REPO_ROOT / "tools" / "sarathictl" / "bench" / "workloads.py"
    assert levels_above('X = Path(__file__).resolve().parents[3].parent / "shared"') == 4
    assert levels_above("Path(__file__).resolve().parent.parent") == 1
    assert levels_above("ROOT = Path(__file__).resolve().parents[1]") == 1
    assert _SIBLING.search('open("../shared/traces/arxiv.csv")')
    depth = len(workloads.relative_to(REPO_ROOT).parts) - 1
    assert depth == 3  # so parents[3].parent (4 levels) is beside the repository


def test_the_session_guard_flags_files_beside_the_checkout() -> None:
    beside = REPO_ROOT.parent / "shared" / "traces" / "arxiv_summarization.csv"
    assert is_outside_the_repository(str(beside))
    assert not is_outside_the_repository(str(REPO_ROOT / "README.md"))
    assert not is_outside_the_repository(str(REPO_ROOT.parent / ".cache" / "x"))
    assert not is_outside_the_repository("/proc/self/status")
