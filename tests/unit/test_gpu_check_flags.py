"""tools/gpu_check.sh runs only where a GPU is lent, seldom and for minutes: every sarathictl
flag it passes must still exist here, or the lease is spent on a usage error."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from sarathictl.cli import main

from tests.conftest import REPO_ROOT

SCRIPT = (REPO_ROOT / "tools" / "gpu_check.sh").read_text()
# Each command the script runs, and how its calls begin there (the script's own `bench NAME
# ARGS...` function runs `bench stage` with ARGS).
COMMANDS = {
    ("bench", "stage"): r'bench "?stage',
    ("bench", "capacity"): r"bench capacity",
    ("model", "random-llama"): r"model random-llama",
}


def flags_passed(command: tuple[str, ...]) -> set[str]:
    """The --flags of every call of `command` in the script (a call runs on over lines that end
    in a backslash)."""
    flags: set[str] = set()
    calls = re.finditer(COMMANDS[command] + r"((?:[^\n]*\\\n)*[^\n]*)", SCRIPT)
    for call in calls:
        flags |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", call.group(1)))
    return flags


def help_text(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = main([*command, "--help"])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", list(COMMANDS), ids=" ".join)
def test_every_flag_the_gpu_check_passes_exists(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    passed = flags_passed(command)
    assert passed, f"the script no longer calls {' '.join(command)}: update COMMANDS"
    known = set(re.findall(r"--[a-z][a-z0-9-]*", help_text(command, capsys)))
    assert passed <= known, f"{' '.join(command)} has no {sorted(passed - known)}"


def test_the_profile_tools_flags_exist() -> None:
    calls = re.findall(r"tools/gpu_decode_profile\.py([^\n]*)", SCRIPT)
    passed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", " ".join(calls)))
    assert passed, "the script no longer runs tools/gpu_decode_profile.py: drop this test"
    usage = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "gpu_decode_profile.py"), "--help"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert passed <= set(re.findall(r"--[a-z][a-z0-9-]*", usage)), usage
