"""The fused elementwise ops on the CPU (stage_worker/csrc/fused_ops.c through cpu_fused.py)
against torch's own ops, the path they replace, on the shapes the served models have: strided
rows as the fused QKV and gate-up matmuls leave them, head sizes that are not powers of two,
bf16 and float32. Rotary rounds where torch does, so it must be equal bit for bit; RMSNorm's
sum and SiLU's exp are ordered and approximated differently, which can move a rounded result by
a step and the scale after it by another: two steps of the dtype."""

from __future__ import annotations

import sys

import pytest
import torch

from stage_worker import native
from stage_worker.layers import RMSNorm, RotaryEmbedding, cpu_fused, fused
from stage_worker.models.llama import silu_mul

pytestmark = pytest.mark.skipif(
    native.fused_kernels() is None, reason="the fused ops need the C module and AVX2 with FMA"
)
DTYPES = [torch.bfloat16, torch.float32]
TOLERANCE = {torch.bfloat16: 2**-6, torch.float32: 1e-5}


@pytest.fixture(autouse=True, params=["avx2", "avx512"])
def bf16_vectors(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Every test on both of the bf16 ops' files: fused_ops_bf16.c (AVX2, any CPU with the
    fused ops) and fused_ops_bf16_avx512.c (where the CPU has AVX-512 with bf16, which picks it
    by default). float32 takes neither."""
    module = native.fused_kernels()
    assert module is not None
    if request.param == "avx512" and not native.module().cpu_supported():
        pytest.skip("this CPU lacks AVX-512 with bf16")
    params = getattr(request.node, "callspec", None)
    if request.param == "avx512" and params and params.params.get("dtype") == torch.float32:
        pytest.skip("float32 runs neither bf16 file: covered once, under avx2")
    was = module.fused_avx512(request.param == "avx512")
    yield request.param
    module.fused_avx512(was)


def rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def torch_ops(fn, *args):  # type: ignore[no-untyped-def]
    fused.set_enabled(False)
    try:
        return fn(*args)
    finally:
        fused.set_enabled(True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim"), [(1, 12, 64), (7, 10, 80), (130, 9, 128), (5, 3, 36)]
)  # 36: half a head is 18, two vectors of 8 and two values after
def test_rotary_equals_torch_bit_for_bit(
    dtype: torch.dtype, tokens: int, heads: int, head_dim: int
) -> None:
    qkv = rand(tokens, (heads + 3) * head_dim, dtype=dtype, seed=tokens + heads)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided rows
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None, "cpu").cos_sin(
        torch.randint(0, 8192, (tokens,), generator=torch.Generator().manual_seed(1)), dtype
    )
    assert fused.kernels_for(x) is cpu_fused  # what the layers call on this CPU
    out = cpu_fused.rotary(x, cos, sin)
    expected = torch_ops(RotaryEmbedding.apply, x, cos, sin)
    differ = out != expected
    assert not differ.any(), f"{int(differ.sum())} of {out.numel()} differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 576), (33, 4096), (3, 1000), (2, 579)])
def test_rms_norm_within_two_rounding_steps_of_torch(
    dtype: torch.dtype, tokens: int, hidden: int
) -> None:
    norm = RMSNorm(hidden, 1e-5, "cpu", dtype)
    norm.weight.data.copy_(rand(hidden, dtype=dtype, seed=1))
    x = (rand(tokens, hidden + 64, dtype=dtype, seed=hidden) * 3)[:, :hidden]  # strided rows
    out, expected = norm(x), torch_ops(norm, x)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "width"), [(1, 1536), (17, 1000), (2, 8), (3, 19)])
def test_silu_mul_within_two_rounding_steps_of_torch(
    dtype: torch.dtype, tokens: int, width: int
) -> None:
    gate_up = (rand(tokens, 2 * width + 8, dtype=dtype, seed=width) * 6)[:, : 2 * width]
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating and zero gates
    out, expected = silu_mul(gate_up), torch_ops(silu_mul, gate_up)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_chunks_ops_on_several_threads_equal_one_thread_bit_for_bit(
    dtype: torch.dtype,
) -> None:
    """A 512-token chunk's ops share their rows out over the threads (fused_ops.c); every row is
    computed alone, so the thread count must not move a bit."""
    tokens, hidden, width, heads, head_dim = 512, 576, 1536, 9, 64
    x = (rand(tokens, hidden + 64, dtype=dtype, seed=1) * 3)[:, :hidden]  # strided rows
    weight = rand(hidden, dtype=dtype, seed=2)
    gate_up = (rand(tokens, 2 * width + 8, dtype=dtype, seed=3) * 6)[:, : 2 * width]
    q = rand(tokens, heads + 3, head_dim, dtype=dtype, seed=4)[:, :heads]
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None, "cpu").cos_sin(torch.arange(tokens), dtype)

    def run() -> list[torch.Tensor]:
        return [
            cpu_fused.rms_norm(x, weight, 1e-5),
            cpu_fused.silu_mul(gate_up),
            cpu_fused.rotary(q, cos, sin),
        ]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run()
        torch.set_num_threads(3)
        shared = run()
    finally:
        torch.set_num_threads(before)
    for a, b in zip(alone, shared, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_stays_a_nan(dtype: torch.dtype) -> None:
    """bf16 rounding (fused_ops_bf16.c) keeps a NaN a NaN, as torch's conversion does, and it
    spreads no further than the reference's would: SiLU's one value, RMSNorm's one row."""
    gate_up = torch.ones(1, 32, dtype=dtype)
    gate_up[0, 0] = float("nan")
    out = cpu_fused.silu_mul(gate_up)  # [1, 16]
    assert out[0, 0].isnan() and not out[0, 1:].isnan().any()
    x = torch.ones(2, 16, dtype=dtype)
    x[1, 5] = float("nan")
    normed = cpu_fused.rms_norm(x, torch.ones(16, dtype=dtype), 1e-6)
    assert normed[1].isnan().all() and not normed[0].isnan().any()


def test_the_module_names_a_bad_argument() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        cpu_fused.rms_norm(x, torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="weight: dtype differs from x's"):
        cpu_fused.rms_norm(x, torch.randn(8).to(torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        cpu_fused.silu_mul(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="cos"):
        cpu_fused.rotary(torch.randn(2, 3, 8), torch.randn(2, 1, 6), torch.randn(2, 1, 6))


def test_the_switch_falls_back_to_torch_and_triton_is_never_imported() -> None:
    x = torch.randn(3, 64)
    fused.set_enabled(False)
    try:
        assert fused.kernels_for(x) is None
    finally:
        fused.set_enabled(True)
    assert fused.kernels_for(x) is cpu_fused
    assert "stage_worker.layers.triton_ops" not in sys.modules


def test_the_avx512_file_runs_where_it_is_picked(bf16_vectors: str) -> None:
    """The one place the two bf16 files differ by design: vcvtneps2bf16 flushes a denormal
    result to zero, where fused_ops_bf16.c (and torch) keep it. So this tells which file ran."""
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 0] = 1.0  # normed: 4.0 (the root of 16) in lane 0
    weight = torch.full((16,), 1e-39, dtype=torch.bfloat16)  # 4e-39 after: a denormal
    out = cpu_fused.rms_norm(x, weight, 0.0)
    if bf16_vectors == "avx512":
        assert out[0, 0].item() == 0.0
    else:
        assert out[0, 0].item() == pytest.approx(4e-39, rel=2**-6)
