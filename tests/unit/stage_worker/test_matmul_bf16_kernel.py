"""The bf16 matmul kernel for steps of a few tokens (stage_worker/layers/matmul_bf16.py): its
products against float32, its thread count, the layers' dispatch to it (and past it to
oneDNN), and the switch that turns it off."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from stage_worker import native
from stage_worker.comm import TPGroup
from stage_worker.layers import (
    ColumnParallelLinear,
    cpu_matmul,
    exact_logits,
    gemv,
    matmul_bf16,
)
from stage_worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(
    native.kernels() is None, reason="the bf16 kernels do not run here (AVX-512 with bf16)"
)


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return matmul_bf16.linear(x, matmul_bf16.pack(w))


# k: whole pairs, an odd count (the last input alone), a single input; m: one token, the
# two-sums path (< 8), one block of 24, and blocks past it. From 16 tokens holding 48 Ki
# inputs (tokens times k: here k = 1025 from 48 tokens, 4096 from 24, 576 at 101): groups of
# four panels against six tokens, the last block short at 101; past 2048 inputs, in passes of
# 2048 over k (4096; 4097 with its last input alone; 5001, its last pass short). n: a partial
# panel, and at 200 (13 panels) groups of four and one, the last partial.
@pytest.mark.parametrize("k", [5001, 4097, 4096, 1025, 576, 96, 33, 7, 1])
@pytest.mark.parametrize("m", [1, 5, 8, 24, 25, 48, 64, 101])
@pytest.mark.parametrize("n", [37, 200])
def test_products_match_float32_to_bf16_rounding(m: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k * 100 + m + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    got = product(x, w)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    want = x.float() @ w.float().T  # exact products of bf16 inputs, float32 sums
    # One bf16 rounding of the result (2^-8 relative), plus float32 sums in another order.
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-4 * k)


@pytest.mark.usefixtures("threads")
# a block per panel; groups of panels; groups in two passes over k, the partial sums per thread
@pytest.mark.parametrize(("m", "k"), [(12, 576), (60, 1024), (60, 4097)])
def test_the_thread_count_moves_no_bit(m: int, k: int) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(1000, k, generator=gen).to(torch.bfloat16)  # 63 panels, the last partial
    packed = matmul_bf16.pack(w)
    torch.set_num_threads(1)
    one = matmul_bf16.linear(x, packed)
    torch.set_num_threads(2)
    assert torch.equal(matmul_bf16.linear(x, packed), one)


@pytest.mark.parametrize(("m", "k"), [(3, 64), (25, 63), (64, 33), (64, 1025)])
def test_strided_input_rows_are_read_correctly(m: int, k: int) -> None:
    x = torch.randn(m, k + 63).to(torch.bfloat16)[:, :k]  # row stride k + 63, k features
    w = torch.randn(40, k).to(torch.bfloat16)
    torch.testing.assert_close(
        product(x, w).float(), x.float() @ w.float().T, rtol=2**-7, atol=1e-4 * k
    )


def test_x_of_another_width_is_refused() -> None:
    packed = matmul_bf16.pack(torch.randn(48, 66).to(torch.bfloat16))
    with pytest.raises(ValueError, match="65 features"):  # 33 pairs hold 65 inputs too
        matmul_bf16.linear(torch.randn(2, 65).to(torch.bfloat16), packed)


@pytest.mark.parametrize("reach", [matmul_bf16.MAX_TOKENS, 8], ids=["default", "measured-8"])
def test_layers_run_a_few_tokens_on_the_kernel_and_more_on_onednn(
    monkeypatch: pytest.MonkeyPatch, reach: int
) -> None:
    monkeypatch.setattr(matmul_bf16.REACH, "max_tokens", reach)  # as a worker measured it
    layer = ColumnParallelLinear(64, 48, "cpu", torch.bfloat16)
    weight = torch.randn(48, 64).to(torch.bfloat16)
    layer.load(weight)
    layer.pack()
    assert layer.bf16 is not None and layer.weight.is_mkldnn  # both layouts held
    calls: list[int] = []
    kernel = matmul_bf16.linear

    def counted(x: torch.Tensor, w: matmul_bf16.PackedBf16) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, w)

    monkeypatch.setattr(matmul_bf16, "linear", counted)
    for tokens in (1, reach, reach + 1):
        x = torch.randn(tokens, 64).to(torch.bfloat16)
        torch.testing.assert_close(
            layer(x).float(), x.float() @ weight.float().T, rtol=2**-7, atol=0.05
        )
    assert calls == [1, reach]


# one panel at a time (k = 101); groups of panels, in two passes over k at 4097
@pytest.mark.parametrize(("m", "k"), [(1, 101), (7, 101), (30, 101), (101, 576), (24, 4097)])
def test_float32_out_is_the_sums_the_bf16_out_rounds(m: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    packed = matmul_bf16.pack(torch.randn(37, k, generator=gen).to(torch.bfloat16))
    sums = matmul_bf16.linear(x, packed, torch.float32)
    assert sums.dtype == torch.float32
    # vcvtneps2bf16 rounds as torch does (nearest, ties to even): the same bits
    assert torch.equal(matmul_bf16.linear(x, packed), sums.to(torch.bfloat16))


@pytest.mark.parametrize("reach", [matmul_bf16.MAX_TOKENS, 2], ids=["default", "measured-2"])
def test_the_lm_head_takes_it_with_float32_logits(
    monkeypatch: pytest.MonkeyPatch, reach: int
) -> None:
    monkeypatch.setattr(matmul_bf16.REACH, "max_tokens", reach)  # the layers' reach, measured
    head = ParallelLMHead(100, 64, TPGroup(), "cpu", torch.bfloat16)
    weight = torch.randn(100, 64).to(torch.bfloat16)
    head.weight.data.copy_(weight)
    head.pack(None)
    assert head.bf16 is not None
    refined: list[int] = []
    refine = exact_logits.refine

    def counted(logits: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        refined.append(logits.shape[0])
        return refine(logits, *args)

    monkeypatch.setattr(exact_logits, "refine", counted)
    for rows in (reach, reach + 1):  # the kernel's float32 sums; oneDNN's, refined
        hidden = torch.randn(rows, 64).to(torch.bfloat16)
        logits = head(hidden)
        want = hidden.float() @ weight.float().T
        assert logits.dtype == torch.float32
        if rows <= reach:  # float32 sums in another order: float32's error
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(logits, want, rtol=2**-7, atol=0.05)
    assert refined == [reach + 1]  # nothing rounded, nothing to refine


def test_a_tied_head_keeps_the_embedding_rows_and_takes_the_kernel() -> None:
    embedding = VocabParallelEmbedding(100, 64, TPGroup(), "cpu", torch.bfloat16)
    embedding.weight.data.copy_(torch.randn(100, 64).to(torch.bfloat16))
    head = ParallelLMHead(100, 64, TPGroup(), "cpu", torch.bfloat16)
    head.weight = embedding.weight
    head.pack(embedding)
    assert head.bf16 is not None and head.weight is embedding.weight  # rows kept for lookups
    hidden = torch.randn(2, 64).to(torch.bfloat16)
    want = hidden.float() @ embedding.weight.float().T
    torch.testing.assert_close(head(hidden), want, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([3, 97])
    assert torch.equal(embedding(ids), embedding.weight[ids])


@pytest.mark.usefixtures("threads")
def test_the_small_batch_gemv_stands_aside_where_the_kernel_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gemv, "_enabled", True)  # --small-batch-kernel, one thread
    torch.set_num_threads(1)
    layer = ColumnParallelLinear(64, 48, "cpu", torch.bfloat16)
    layer.load(torch.randn(48, 64).to(torch.bfloat16))
    layer.pack()
    assert layer.bf16 is not None and layer.plain is None  # no third copy


def test_no_cpu_matmul_kernel_leaves_bf16_to_onednn() -> None:
    cpu_matmul.set_enabled(False)
    try:
        layer = ColumnParallelLinear(64, 48, "cpu", torch.bfloat16)
        layer.load(torch.randn(48, 64).to(torch.bfloat16))
        layer.pack()
    finally:
        cpu_matmul.set_enabled(True)
    assert layer.bf16 is None and layer.weight.is_mkldnn


def test_the_module_refuses_panels_of_another_weight() -> None:
    module = native.kernels()
    assert module is not None
    x = torch.randn(2, 64).to(torch.bfloat16)
    panels = matmul_bf16.pack(torch.randn(48, 66).to(torch.bfloat16)).panels  # 33 pairs, not 32
    out = torch.empty(2, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="panels"):
        module.matmul_bf16(native.capsule(x), native.capsule(panels), native.capsule(out), 1)


def test_its_benchmark_prints_a_row_per_token_count(capsys: pytest.CaptureFixture[str]) -> None:
    """tools/bench_bf16_matmul.py, which BENCHMARKS.md quotes (tiny shapes: not a
    measurement)."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))  # a script there, not installed
    import bench_bf16_matmul

    small = ["--hidden", "32", "--ffn", "48", "--q-heads", "2", "--kv-heads", "1"]
    argv = [*small, "--head-dim", "16", "--layers", "2", "--tokens", "1,3", "--rounds", "2"]
    assert bench_bf16_matmul.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| 1", "| 3"]
