"""tools/ab_attention_builds.py and tools/kv_read_floor.c, which BENCHMARKS.md quotes for the
AVX2 decode kernel: the A/B runs two builds side by side (here the same one twice: equal
outputs), and the floor program compiles."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stage_worker import native
from stage_worker.attention import cpu_kernel
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))  # a script there, not installed

import ab_attention_builds


@pytest.mark.skipif(
    not (cpu_kernel.available() and cpu_kernel.takes_dtype(torch.float32)),
    reason="the attention kernel cannot run float32 here",
)
def test_the_same_build_twice_gives_the_same_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    module = native.fused_kernels()
    assert module is not None
    build = str(module.__file__)
    assert ab_attention_builds.main([build, build, "--points", "1x16,2x40", "--rounds", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[:3] in ("| 1", "| 2")]
    assert [row.split("|")[1:3] for row in rows] == [[" 1 ", " 16 "], [" 2 ", " 40 "]]
    for row in rows:  # A ms, B ms, B/A, the largest difference between the outputs
        cells = [cell.strip() for cell in row.split("|")[3:7]]
        assert float(cells[0]) > 0 and float(cells[1]) > 0
        assert float(cells[3]) == 0.0


@pytest.mark.skipif(
    shutil.which("gcc") is None or platform.machine() != "x86_64", reason="needs gcc on x86-64"
)
def test_the_read_floor_program_compiles(tmp_path: Path) -> None:
    source = REPO_ROOT / "tools" / "kv_read_floor.c"
    flags = ["-O2", "-Wall", "-Werror", "-mavx2", "-mfma", "-fopenmp"]
    result = subprocess.run(
        ["gcc", *flags, str(source), "-o", str(tmp_path / "floor")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
