"""The float32 matmul kernel (stage_worker/csrc/sgemm_f32.c through cpu_matmul.py) against a
float64 matmul, on the token counts a step has (0, decodes of 1 to 6 which take one tile,
counts that split into tiles, a prompt chunk) and output counts that are not a multiple of the
16-wide panel; and the layers that hold float32 weights running it where it can."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from stage_worker import native
from stage_worker.comm import TPGroup
from stage_worker.layers import ColumnParallelLinear, cpu_matmul
from stage_worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.skipif(
    native.fused_kernels() is None, reason="the kernel needs the C module and AVX2 with FMA"
)


def kernels() -> Any:
    """The C module (the tests skip where it does not run)."""
    module = native.fused_kernels()
    assert module is not None
    return module


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("tokens", [0, 1, 2, 5, 6, 7, 8, 13, 130])
@pytest.mark.parametrize(("out", "in_"), [(960, 576), (100, 37), (16, 1536), (3, 8)])
def test_matches_a_float64_matmul(threads: int, tokens: int, out: int, in_: int) -> None:
    weight = rand(out, in_, seed=out) * 0.05  # [out, in]
    x = rand(tokens, in_ + 5, seed=tokens)[:, :in_]  # [T, in], rows strided as a fused matmul's
    y = cpu_matmul.linear(x, cpu_matmul.pack(weight))  # [T, out]
    expected = (x.double() @ weight.double().T).float()
    assert y.shape == (tokens, out)
    # float32 sums over `in_` products in another order than float64's: a few ulps of the sum
    # of magnitudes
    bound = 4 * in_ * torch.finfo(torch.float32).eps * (x.abs() @ weight.abs().T)
    assert ((y - expected).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("tokens", [0, 1, 5, 7, 8, 13, 64, 130])
@pytest.mark.parametrize(("ffn", "in_"), [(1536, 576), (48, 37)])
def test_silu_in_the_gate_up_matmul_equals_the_matmul_then_silu(
    threads: int, tokens: int, ffn: int, in_: int
) -> None:
    cap = native.capsule
    packed = cpu_matmul.pack(rand(2 * ffn, in_, seed=ffn) * 0.2).panels  # [gate; up]: [2F, in]
    x = cap(rand(tokens, in_ + 3, seed=tokens)[:, :in_])  # [T, in], strided rows
    gate_up, expected = torch.empty(tokens, 2 * ffn), torch.empty(tokens, ffn)
    kernels().sgemm_f32(x, cap(packed), cap(gate_up), threads)
    kernels().fused_silu_mul(cap(gate_up), cap(expected), 1)
    got = torch.full((tokens, ffn), float("nan"))
    kernels().sgemm_f32_silu_mul(x, cap(packed), cap(got), threads)
    assert torch.equal(got, expected)  # the same products, the same SiLU: to the bit


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("out", [576, 100])
def test_accumulate_adds_the_product_to_the_stream_as_torch_adds(
    threads: int, tokens: int, out: int
) -> None:
    cap = native.capsule
    packed, x = (
        cap(cpu_matmul.pack(rand(out, 96, seed=out) * 0.1).panels),
        cap(rand(tokens, 96, seed=0)),
    )
    stream = rand(tokens, out, seed=tokens)  # [T, out]: a residual stream
    product = torch.empty(tokens, out)
    kernels().sgemm_f32(x, packed, cap(product), threads)
    expected = stream + product  # what the modules do: x.add_(o_proj(...))
    kernels().sgemm_f32(x, packed, cap(stream), threads, True)
    assert torch.equal(stream, expected)


def test_silu_in_the_matmul_names_a_bad_argument() -> None:
    cap, x = native.capsule, native.capsule(rand(2, 8, seed=1))
    with pytest.raises(ValueError, match="a multiple of the panel"):
        kernels().sgemm_f32_silu_mul(
            x, cap(cpu_matmul.pack(rand(40, 8, seed=0)).panels), cap(torch.empty(2, 20)), 1
        )
    with pytest.raises(ValueError, match="packed: must hold ceil"):
        kernels().sgemm_f32_silu_mul(
            x, cap(cpu_matmul.pack(rand(64, 8, seed=0)).panels), cap(torch.empty(2, 16)), 1
        )


@pytest.mark.parametrize("tokens", [1, 2, 5, 6, 7, 8, 13, 64, 130])
@pytest.mark.parametrize(("out", "in_"), [(960, 576), (100, 37), (3, 8)])
def test_bf16_valued_weights_are_held_as_bf16_and_give_the_float32_products_to_the_bit(
    threads: int, tokens: int, out: int, in_: int
) -> None:
    """A bf16 checkpoint served in float32: half the bytes, the same sums."""
    cap = native.capsule
    weight = (rand(out, in_, seed=out) * 0.05).bfloat16().float()  # [out, in]
    packed = cpu_matmul.pack(weight)
    assert packed.panels.dtype == torch.bfloat16
    x = rand(tokens, in_ + 5, seed=tokens)[:, :in_]  # [T, in], strided rows
    expected = torch.empty(tokens, out)
    float32 = cpu_matmul.pack(weight, bf16_where_exact=False).panels
    kernels().sgemm_f32(cap(x), cap(float32), cap(expected), threads)
    assert torch.equal(cpu_matmul.linear(x, packed), expected)
    stream = rand(tokens, out, seed=1)  # the accumulating form reads the same panels
    added = stream + expected
    kernels().sgemm_f32(cap(x), cap(packed.panels), cap(stream), threads, True)
    assert torch.equal(stream, added)


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_silu_in_the_matmul_on_bf16_panels_equals_it_on_float32_panels(
    threads: int, tokens: int
) -> None:
    cap, ffn, in_ = native.capsule, 48, 37
    weight = (rand(2 * ffn, in_, seed=2) * 0.2).bfloat16().float()  # [gate; up]: [2F, in]
    x = cap(rand(tokens, in_, seed=tokens))
    got, expected = torch.empty(tokens, ffn), torch.empty(tokens, ffn)
    float32 = cpu_matmul.pack(weight, bf16_where_exact=False).panels
    kernels().sgemm_f32_silu_mul(x, cap(float32), cap(expected), threads)
    kernels().sgemm_f32_silu_mul(x, cap(cpu_matmul.pack(weight).panels), cap(got), threads)
    assert torch.equal(got, expected)


def test_a_weight_with_one_value_beyond_bf16_stays_float32() -> None:
    weight = torch.ones(20, 3)
    assert cpu_matmul.pack(weight).panels.dtype == torch.bfloat16
    weight[19, 2] = 1 + 2**-20  # needs float32's low bits
    packed = cpu_matmul.pack(weight)
    assert packed.panels.dtype == torch.float32
    assert torch.equal(cpu_matmul.linear(torch.eye(3), packed), weight.T)


def test_packing_pads_the_last_panel_with_zeros() -> None:
    packed = cpu_matmul.pack(torch.ones(20, 3))
    assert packed.panels.shape == (2, 3, 16) and packed.out_features == 20
    assert packed.panels[1, :, :4].eq(1).all() and packed.panels[1, :, 4:].eq(0).all()


def test_the_module_names_a_bad_argument() -> None:
    module = native.fused_kernels()
    assert module is not None
    cap = native.capsule
    packed = cpu_matmul.pack(rand(20, 8, seed=0))
    with pytest.raises(ValueError, match="packed: its inputs differ"):
        module.sgemm_f32(cap(rand(2, 9, seed=1)), cap(packed.panels), cap(torch.empty(2, 20)), 1)
    with pytest.raises(ValueError, match="packed: must hold ceil"):
        module.sgemm_f32(cap(rand(2, 8, seed=1)), cap(packed.panels), cap(torch.empty(2, 40)), 1)
    with pytest.raises(ValueError, match="x and out must be float32"):
        module.sgemm_f32(
            cap(rand(2, 8, seed=1).bfloat16()), cap(packed.panels), cap(torch.empty(2, 20)), 1
        )
    with pytest.raises(ValueError, match="num_threads: must be >= 1"):
        module.sgemm_f32(cap(rand(2, 8, seed=1)), cap(packed.panels), cap(torch.empty(2, 20)), 0)


def test_float32_layers_run_the_kernel_and_free_the_plain_weight() -> None:
    weight = rand(1536, 576, seed=3) * 0.02
    layer = ColumnParallelLinear(576, 1536, "cpu", torch.float32)
    layer.load(weight)
    x = rand(4, 576, seed=4)
    before = layer(x)  # F.linear, before packing
    layer.pack()
    assert layer.f32 is not None and layer.weight.shape == (96, 576, 16)
    torch.testing.assert_close(layer(x), before, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bf16_values", [False, True], ids=["float32-panels", "bf16-panels"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_float32_head_runs_the_kernel_and_a_tied_embedding_reads_its_panels(
    tied: bool, bf16_values: bool
) -> None:
    weights = rand(1000, 64, seed=5)  # [vocab, hidden]
    if bf16_values:  # a bf16 checkpoint: the panels are bf16, their columns reordered
        weights = weights.bfloat16().float()
    hidden = rand(3, 64, seed=6)
    head = ParallelLMHead(1000, 64, TPGroup(), "cpu", torch.float32)
    head.weight.data.copy_(weights)
    embedding = VocabParallelEmbedding(1000, 64, TPGroup(), "cpu", torch.float32)
    embedding.weight = head.weight
    head.pack(embedding if tied else None)
    assert head.f32 is not None
    assert head.f32.panels.dtype == (torch.bfloat16 if bf16_values else torch.float32)
    torch.testing.assert_close(head(hidden), hidden @ weights.T, atol=1e-4, rtol=1e-4)
    assert (embedding.f32 is head.f32) is tied
    assert (embedding.weight is head.weight) is tied  # tied: one Parameter, the panels
    ids = torch.tensor([0, 999, 4, 7, 8, 11, 12, 15, 16, 17, 512])  # each group of 4 in a panel
    assert torch.equal(embedding(ids), weights[ids])  # held once: the lookups read the panels


def test_switched_off_the_layers_keep_f_linear() -> None:
    cpu_matmul.set_enabled(False)
    try:
        layer = ColumnParallelLinear(8, 32, "cpu", torch.float32)
        layer.pack()
        assert layer.f32 is None and layer.weight.shape == (32, 8)
    finally:
        cpu_matmul.set_enabled(True)


@pytest.mark.parametrize("bf16_values", [False, True], ids=["float32", "bf16-values"])
def test_its_benchmark_times_another_build_beside_this_one(
    capsys: pytest.CaptureFixture[str], bf16_values: bool
) -> None:
    """tools/bench_cpu_matmul.py --baseline, which BENCHMARKS.md quotes: this build against
    itself here (tiny points: not a measurement), each point checked for equal outputs; with
    --bf16-values the kernel's bf16 panels against the baseline's float32 ones, and against
    the float32 panels in this build."""
    import sys

    from tests.conftest import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "tools"))  # a script there, not installed
    import bench_cpu_matmul

    so = native.module().__file__
    assert so is not None
    argv = ["--tokens", "1,7", "--layers", "1", "--rounds", "1", "--baseline", so, "--no-torch"]
    assert bench_cpu_matmul.main(argv + (["--bf16-values"] if bf16_values else [])) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert "baseline build ms" in rows[0] and rows[0].endswith("| baseline build / kernel |")
    assert ("float32 panels / kernel" in rows[0]) is bf16_values
    assert "MKL" not in rows[0]  # --no-torch
    assert [row.split(" | ")[0] for row in rows[2:]] == ["| 1", "| 7"]
    assert all(row.endswith("x |") for row in rows[2:])
