"""`sarathictl bench stage` runs end to end on a tiny checkpoint and reports every point."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from sarathictl.cli import main

KINDS = ("decode", "prefill", "chunk")


def test_bench_stage_reports_decode_and_prefill_points_and_the_floor(
    tiny_checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "stage", "--model", str(tiny_checkpoint("llama")), "--dtype", "float32"]
    argv += ["--decode-batches", "1,8", "--prefill-chunks", "32,96", "--later-chunks", "48"]
    argv += ["--context-tokens", "200"]
    assert main([*argv, "--repeats", "1", "--copy-bytes", "1000000", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tokens = {k: [r["tokens"] for r in report["rows"] if r["kind"] == k] for k in KINDS}
    assert tokens == {"decode": [1, 8], "prefill": [32, 96], "chunk": [48]}
    assert all(r["step_ms"] > 0 for r in report["rows"])
    assert report["copy_bandwidth_gb_s"] > 0
    assert report["decode1_over_floor"] == pytest.approx(
        report["rows"][0]["step_ms"] / report["decode_floor_ms"]
    )
    # on the CPU each step is split as a worker's step log splits it: parts within the step
    for r in report["rows"]:
        assert r["linear_ms"] > 0 and r["attention_ms"] > 0
    # timed in runs apart from step_ms's, single sub-millisecond ones here: a loose bound over
    # all the points together, which one preempted run cannot break as it could one point's
    parts_ms = sum(r["linear_ms"] + r["attention_ms"] for r in report["rows"])
    assert parts_ms < 3 * sum(r["step_ms"] for r in report["rows"])
    # the scheduler's cost profile, fitted to the points: --step-cost for the controller
    fixed, per_token, per_attended = report["step_cost"]
    assert fixed >= 0 and per_token > 0 and per_attended >= 0


def test_random_shape_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    from stage_worker.config import load_spec

    argv = ["bench", "stage", "--model", str(tmp_path / "m"), "--random-shape", "tiny"]
    argv += ["--decode-batches", "2", "--prefill-chunks", "16"]
    assert main([*argv, "--repeats", "1", "--copy-bytes", "1000000"]) == 0
    spec = load_spec(tmp_path / "m")
    assert (spec.num_layers, spec.hidden_size, spec.num_kv_heads) == (2, 64, 2)
    assert spec.tie_word_embeddings


def test_later_chunks_alone_are_timed_against_the_prefill_ceiling(
    tiny_checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "stage", "--model", str(tiny_checkpoint("llama")), "--dtype", "float32"]
    argv += ["--decode-batches", "", "--prefill-chunks", "", "--later-chunks", "16,64"]
    assert main([*argv, "--repeats", "1", "--copy-bytes", "1000000", "--matmul-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "| chunk | 16 |" in out and "| chunk | 64 |" in out
    assert "of the ceiling" in out and "prefill ceiling" in out


def test_the_step_cost_fit_counts_a_later_chunk_s_cached_keys() -> None:
    """Rows made from known coefficients are fitted back to them: a chunk of n tokens after c
    cached attends n c + n (n + 1) / 2 keys, not the n (n + 1) / 2 of a first chunk."""
    from sarathictl.bench.stage_step import Row, fit_step_cost

    fixed, per_token, per_key, context = 0.004, 2e-5, 3e-8, 3000

    def ms(tokens: int, keys: float) -> float:
        return (fixed + per_token * tokens + per_key * keys) * 1e3

    rows = [Row("decode", b, ms(b, b * (context + 1))) for b in (1, 8, 32)]
    rows += [Row("chunk", n, ms(n, n * context + n * (n + 1) / 2)) for n in (128, 512)]
    rows += [Row("prefill", 512, ms(512, 512 * 513 / 2))]
    fit = fit_step_cost(rows, context)
    assert fit == pytest.approx((fixed, per_token, per_key), rel=1e-6)
