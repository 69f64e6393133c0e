"""The decode fast paths compute what the general ones do: oneDNN-packed bf16 weights give
bit-identical matmuls, packed float32 ones the same within rounding, and a decode-only step
attends exactly as decodes mixed with a prefill. (The float32 AVX2 kernel, which takes float32
weights before oneDNN where it runs, has its own tests: test_cpu_matmul.py.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from stage_worker.attention import SeqSlice
from stage_worker.attention.base import build_metadata
from stage_worker.attention.torch_backend import TorchAttention
from stage_worker.layers import ColumnParallelLinear, cpu_matmul, onednn

needs_bf16_onednn = pytest.mark.skipif(
    not onednn.can_pack(torch.empty(1, 1, dtype=torch.bfloat16)), reason="no oneDNN bf16 here"
)


@needs_bf16_onednn
@pytest.mark.parametrize("tokens", [0, 1, 5, 64])
def test_packed_bf16_linear_is_bit_identical(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    layer = ColumnParallelLinear(96, 160, "cpu", torch.bfloat16)
    layer.load(torch.randn(160, 96, generator=gen).to(torch.bfloat16))
    x = torch.randn(tokens, 96, generator=gen).to(torch.bfloat16)  # [T, in]
    plain = layer(x)  # [T, out]
    layer.pack()
    assert layer.weight.is_mkldnn
    assert torch.equal(layer(x), plain)


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """Sets torch's thread count for the test and puts it back after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def without_f32_kernel() -> Iterator[None]:
    """The float32 AVX2 kernel off (--no-cpu-matmul-kernel), as on a CPU without AVX2."""
    cpu_matmul.set_enabled(False)
    yield
    cpu_matmul.set_enabled(True)


@pytest.mark.usefixtures("without_f32_kernel")
def test_float32_weights_stay_plain_on_one_thread(threads: Callable[[int], None]) -> None:
    threads(1)  # MKL's F.linear is the faster one there
    layer = ColumnParallelLinear(8, 4, "cpu", torch.float32)
    layer.pack()
    assert not layer.weight.is_mkldnn


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.usefixtures("without_f32_kernel")
@pytest.mark.parametrize("tokens", [1, 4, 33])
def test_float32_weights_are_packed_on_two_threads_and_compute_the_same(
    threads: Callable[[int], None], tokens: int
) -> None:
    threads(2)  # MKL spreads no matmul of a few rows over threads; oneDNN does
    gen = torch.Generator().manual_seed(tokens)
    layer = ColumnParallelLinear(576, 1536, "cpu", torch.float32)
    layer.load(torch.randn(1536, 576, generator=gen) * 0.02)
    x = torch.randn(tokens, 576, generator=gen)  # [T, in]
    plain = layer(x)  # [T, out]
    layer.pack()
    assert layer.weight.is_mkldnn
    torch.testing.assert_close(layer(x), plain, atol=1e-4, rtol=1e-4)  # another summation order


def test_decode_only_step_matches_decodes_beside_a_prefill() -> None:
    gen = torch.Generator().manual_seed(0)
    block_size, hq, hkv, d = 4, 4, 2, 8
    k_cache = torch.randn(16, block_size, hkv, d, generator=gen)  # [blocks, bs, Hkv, D]
    v_cache = torch.randn(16, block_size, hkv, d, generator=gen)
    # two decodes with different context lengths (so the padding mask is used)
    decodes = [SeqSlice(0, 1, 7, (0, 1)), SeqSlice(1, 1, 10, (2, 3, 4))]
    prefill = SeqSlice(2, 5, 5, (5, 6))
    q = torch.randn(7, hq, d, generator=gen)  # [T, Hq, D]: decodes first, then the prefill
    k = torch.randn(7, hkv, d, generator=gen)
    v = torch.randn(7, hkv, d, generator=gen)

    def attend(seqs: list[SeqSlice], rows: int) -> torch.Tensor:
        backend, meta = TorchAttention(), build_metadata(seqs, block_size, "cpu")
        backend.prepare(meta, hq, hkv, d)
        kc, vc = k_cache.clone(), v_cache.clone()
        return backend.forward(q[:rows], k[:rows], v[:rows], kc, vc, meta)  # [rows, Hq, D]

    alone = attend(decodes, 2)
    mixed = attend([*decodes, prefill], 7)
    assert torch.equal(alone, mixed[:2])
