"""The fused Triton kernels (stage_worker/layers/triton_ops.py) against torch's own ops, the
path they replace, on fresh random inputs of the shapes the served models have (strided rows
as the fused QKV and gate-up matmuls leave them, head sizes that are not powers of two).

Tolerances: rotary rounds where the reference does, so it must be equal bit for bit. SiLU's
`exp` and RMSNorm's float32 sum may differ from torch's in their last bit, which can move the
rounded result by a step, and the scale that follows by another: two steps of the dtype
(bf16: 2**-6 relative; float32: 1e-5)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from stage_worker.layers import RMSNorm, RotaryEmbedding, fused
from stage_worker.models.llama import silu_mul

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]
DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float32]
TOLERANCE = {torch.bfloat16: 2**-6, torch.float32: 1e-5}


def rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def poison_allocator() -> None:
    """Leaves NaN in the memory the next allocations reuse: an unwritten output shows."""
    if DEVICE == "cuda":
        torch.full((64 << 20,), float("nan"), device=DEVICE)


def reference(fn, *args):  # type: ignore[no-untyped-def]
    fused.set_enabled(False)
    try:
        return fn(*args)
    finally:
        fused.set_enabled(True)


def kernels():  # type: ignore[no-untyped-def]
    from stage_worker.layers import triton_ops

    return triton_ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 40, 128), (7, 10, 80), (300, 9, 64)])
def test_rotary_equals_torch_bit_for_bit(
    dtype: torch.dtype, tokens: int, heads: int, head_dim: int
) -> None:
    # q and k heads as the layer passes them: a view into the fused QKV output (strided rows)
    qkv = rand(tokens, (heads + 3) * head_dim, dtype=dtype, seed=tokens + heads)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    rope = RotaryEmbedding(head_dim, 10000.0, None, DEVICE)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    poison_allocator()
    out = kernels().rotary(x, cos, sin)
    expected = reference(RotaryEmbedding.apply, x, cos, sin)
    differ = out != expected
    worst = (out.float() - expected.float()).abs().max().item()
    assert not differ.any(), f"{int(differ.sum())} of {out.numel()} differ, by up to {worst}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 4096), (33, 576), (5, 14848)])
def test_rms_norm_within_two_rounding_steps_of_torch(
    dtype: torch.dtype, tokens: int, hidden: int
) -> None:
    norm = RMSNorm(hidden, 1e-5, DEVICE, dtype)
    norm.weight.data.copy_(rand(hidden, dtype=dtype, seed=1))
    wide = rand(tokens, hidden + 64, dtype=dtype, seed=hidden) * 3
    x = wide[:, :hidden]  # strided rows
    poison_allocator()
    out = kernels().rms_norm(x, norm.weight, norm.eps)
    expected = reference(norm, x)
    assert not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 4096), (33, 576)])
def test_add_rms_norm_sums_as_torch_and_norms_within_two_rounding_steps(
    dtype: torch.dtype, tokens: int, hidden: int
) -> None:
    norm = RMSNorm(hidden, 1e-5, DEVICE, dtype)
    norm.weight.data.copy_(rand(hidden, dtype=dtype, seed=2))
    x = rand(tokens, hidden, dtype=dtype, seed=hidden) * 3
    delta = rand(tokens, hidden + 64, dtype=dtype, seed=hidden + 1)[:, :hidden]  # strided rows
    poison_allocator()
    total, out = norm.add_forward(x, delta)
    expected_total, expected = reference(norm.add_forward, x, delta)
    assert torch.equal(total, x + delta) and torch.equal(expected_total, total)
    assert not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "width"), [(1, 14336), (17, 1536), (4, 1000)])
def test_silu_mul_within_two_rounding_steps_of_torch(
    dtype: torch.dtype, tokens: int, width: int
) -> None:
    gate_up = rand(tokens, 2 * width + 8, dtype=dtype, seed=width)[:, : 2 * width] * 4
    poison_allocator()
    out = kernels().silu_mul(gate_up)
    expected = reference(silu_mul, gate_up)
    assert out.shape == (tokens, width) and not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_layers_take_the_fused_path_on_cuda() -> None:
    """The switch users have: on by default, and --no-fused-ops really falls back."""
    x = rand(3, 64, dtype=torch.bfloat16, seed=0)
    assert fused.kernels_for(x) is not None
    fused.set_enabled(False)
    try:
        assert fused.kernels_for(x) is None
    finally:
        fused.set_enabled(True)
    assert fused.kernels_for(x.cpu()) is None
