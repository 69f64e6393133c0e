"""tools/bench_chunk_attention.py, the chunk-attention microbenchmark gpu_check.sh runs, prints
one row per context with both timings (tiny points on the CPU: a second, not a measurement)."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))  # a script there, not installed

import bench_chunk_attention


def test_it_prints_a_row_per_context(capsys: pytest.CaptureFixture[str]) -> None:
    bench_chunk_attention.main(["--device", "cpu", "--chunk", "8", "--contexts", "16,40"])
    rows = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 16 ") or line.startswith("| 40 ")
    ]
    assert len(rows) == 2
    for row in rows:
        masked, biased = (float(cell) for cell in row.strip("|").split("|")[1:3])
        assert masked > 0 and biased > 0
