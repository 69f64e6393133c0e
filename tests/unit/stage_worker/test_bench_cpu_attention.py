"""tools/bench_cpu_attention.py, the attention microbenchmark BENCHMARKS.md quotes, runs and
prints one row per point (tiny points: a second, not a measurement)."""

from __future__ import annotations

import sys

import pytest
import torch

from stage_worker.attention import cpu_kernel
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))  # a script there, not installed

import bench_cpu_attention


@pytest.mark.skipif(
    not (cpu_kernel.available() and cpu_kernel.takes_dtype(torch.float32)),
    reason="the attention kernel cannot run float32 here",
)
def test_it_prints_a_row_per_point(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        code = bench_cpu_attention.main(
            ["--points", "1x16,2x40", "--chunks", "7@0,5@33", "--layers", "2", "--rounds", "1"]
        )
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line[:3] in ("| 1", "| 2", "| 7", "| 5")]
    assert code == 0
    assert [row.split("|")[1:3] for row in rows] == [
        [" 1 ", " 16 "], [" 2 ", " 40 "], [" 7 ", " 0 "], [" 5 ", " 33 "]
    ]  # fmt: skip
    for row in rows:  # ms of both paths, the kernel's GB/s or ns a pair, then a ratio
        kernel_ms, torch_ms, kernel_gb_s = (float(cell) for cell in row.split("|")[3:6])
        assert min(kernel_ms, torch_ms, kernel_gb_s) >= 0  # tiny points round to 0.0
        assert row.split("|")[6].strip().endswith("x")


def test_a_malformed_point_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_cpu_attention.main(["--chunks", "48x3"])
    assert "--chunks: '48x3': expected N@M" in capsys.readouterr().err
