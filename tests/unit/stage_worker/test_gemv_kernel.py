"""The small-batch bf16 GEMV kernel (stage_worker/layers/gemv.py): its products against float32,
the layers' dispatch to it, and the fallback where the install has no kernels."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from stage_worker import native
from stage_worker.layers import ColumnParallelLinear, cpu_matmul, gemv


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel enabled with one torch thread (the bf16 matmul kernel, which supersedes it,
    off), or the test skipped where it cannot run."""
    monkeypatch.setattr(gemv, "_enabled", True)
    monkeypatch.setattr(cpu_matmul, "_enabled", False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not gemv.usable_for(torch.zeros(4, 4, dtype=torch.bfloat16)):
            pytest.skip("the GEMV kernel cannot run here (no AVX-512 with bf16)")
        yield
    finally:
        torch.set_num_threads(threads)


# k values cover whole 64-value steps, a 32-value step and masked tails.
@pytest.mark.parametrize("k", [576, 1536, 96, 100, 33, 7])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_products_match_float32_to_bf16_rounding(kernel: None, m: int, k: int) -> None:
    gen = torch.Generator().manual_seed(k * 10 + m)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(37, k, generator=gen).to(torch.bfloat16)  # 37 rows: no multiple of anything
    got = gemv.linear(x, w)
    assert got.shape == (m, 37) and got.dtype == torch.bfloat16
    want = x.float() @ w.float().T  # exact products of bf16 inputs, float32 sums
    # One bf16 rounding of the result (2^-8 relative), plus float32 sums in another order.
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-4 * k)


def test_a_strided_input_row_is_read_correctly(kernel: None) -> None:
    x = torch.randn(3, 128).to(torch.bfloat16)[:, :64]  # row stride 128, 64 features
    w = torch.randn(8, 64).to(torch.bfloat16)
    torch.testing.assert_close(
        gemv.linear(x, w).float(), x.float() @ w.float().T, rtol=2**-7, atol=0.01
    )


def test_layers_run_steps_of_a_few_tokens_on_the_kernel(kernel: None) -> None:
    layer = ColumnParallelLinear(64, 48, "cpu", torch.bfloat16)
    weight = torch.randn(48, 64).to(torch.bfloat16)
    layer.load(weight)
    layer.pack()
    assert layer.plain is not None and torch.equal(layer.plain, weight)
    for tokens in (1, gemv.MAX_TOKENS, gemv.MAX_TOKENS + 1):  # kernel, kernel, oneDNN
        x = torch.randn(tokens, 64).to(torch.bfloat16)
        torch.testing.assert_close(
            layer(x).float(), x.float() @ weight.float().T, rtol=2**-7, atol=0.05
        )


def test_off_by_default_and_the_layer_keeps_one_copy() -> None:
    layer = ColumnParallelLinear(64, 48, "cpu", torch.bfloat16)
    layer.load(torch.randn(48, 64).to(torch.bfloat16))
    layer.pack()
    assert layer.plain is None


def test_an_install_without_kernels_falls_back_with_the_reason_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def missing() -> None:
        raise ImportError("No module named 'stage_worker._kernels'")

    monkeypatch.setattr(gemv, "_enabled", True)
    monkeypatch.setattr(native, "module", missing)
    native.kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="stage_worker.native"):
            assert native.kernels() is None
            assert not gemv.usable_for(torch.zeros(4, 4, dtype=torch.bfloat16))
        assert "the C kernels are not in this install" in caplog.text
        assert caplog.text.count("not in this install") == 1  # said once, however often asked
    finally:
        native.kernels.cache_clear()  # the next test finds the real module
