"""The C decode-attention kernel (stage_worker/attention/decode_kernel.py) against the torch
path it replaces, on ragged contexts over scattered blocks, and the backend's use of it."""

from __future__ import annotations

import pytest
import torch

from stage_worker.attention import SeqSlice, decode_kernel
from stage_worker.attention.base import build_metadata
from stage_worker.attention.torch_backend import TorchAttention, paged_decode

BLOCK_SIZE = 16

needs_kernel = pytest.mark.skipif(
    decode_kernel._kernel() is None, reason="the decode kernel cannot run here (no AVX-512)"
)


def _case(
    lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """q [B, Hq, D], caches [blocks, bs, Hkv, D], a shuffled block table [B, max_blocks]."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks_per) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks out of order
    table = torch.zeros(len(lens), max(blocks_per), dtype=torch.int64)
    at = 0
    for b, n in enumerate(blocks_per):
        table[b, :n] = torch.tensor(order[at : at + n])
        at += n
    shape = (num_blocks, BLOCK_SIZE, hkv, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = (torch.randn(len(lens), hq, d, generator=gen) * 2).to(dtype)  # sharper softmax
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int64)


def _reference(q, k_cache, v_cache, table, lens) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The torch path in float32: [B, Hq, D]."""
    max_len = int(lens.max())
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    return paged_decode(q.float(), k_cache.float(), v_cache.float(), table.flatten(), max_len, mask)


@needs_kernel
@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d"),
    [
        ([1], 4, 4, 64),  # one position, no grouping
        ([17, 600, 33, 1, 250], 9, 3, 64),  # the demo model's heads, ragged, block tails
        ([300, 129], 29, 1, 64),  # Falcon-180B's TP-4 group of 29 query heads
        ([5, 40], 8, 2, 128),
        ([64], 2, 1, 256),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_torch_path(
    lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype
) -> None:
    q, k_cache, v_cache, table, context = _case(lens, hq, hkv, d, dtype, seed=len(lens) + d)
    scratch = torch.empty(decode_kernel.scratch_floats(hq, hkv, d, max(lens)))
    got = decode_kernel.paged_decode(q, k_cache, v_cache, table, context, scratch)
    assert got.shape == q.shape and got.dtype == dtype
    want = _reference(q, k_cache, v_cache, table, context)
    # float32: summation order only; bf16: the output rounded once (2^-8 relative)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=4e-3)
    torch.testing.assert_close(got.float(), want, **tol)  # type: ignore[arg-type]


@needs_kernel
def test_a_strided_query_is_read_right() -> None:
    q, k_cache, v_cache, table, context = _case([40, 70], 4, 2, 64, torch.float32, seed=3)
    wide = torch.cat([q, torch.zeros_like(q)], dim=2)[:, :, :64]  # non-contiguous view of q
    scratch = torch.empty(decode_kernel.scratch_floats(4, 2, 64, 70))
    got = decode_kernel.paged_decode(wide, k_cache, v_cache, table, context, scratch)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, table, context))


@needs_kernel
def test_the_backend_takes_the_kernel_and_agrees_with_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d = 6, 2, 64
    k_cache = torch.randn(12, BLOCK_SIZE, hkv, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(12, BLOCK_SIZE, hkv, d, generator=gen).to(torch.bfloat16)
    seqs = [SeqSlice(0, 1, 20, (3, 7)), SeqSlice(1, 1, 45, (0, 1, 9)), SeqSlice(2, 6, 6, (5,))]
    q = torch.randn(8, hq, d, generator=gen).to(torch.bfloat16)  # [T, Hq, D]
    k = torch.randn(8, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(8, hkv, d, generator=gen).to(torch.bfloat16)
    calls: list[int] = []
    kernel = decode_kernel.paged_decode

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)

    def attend(rows: int) -> torch.Tensor:
        backend, meta = TorchAttention(), build_metadata(seqs[: 3 if rows > 2 else 2], 16, "cpu")
        backend.prepare(meta, hq, hkv, d)
        kc, vc = k_cache.clone(), v_cache.clone()
        return backend.forward(q[:rows], k[:rows], v[:rows], kc, vc, meta)

    monkeypatch.setattr(decode_kernel, "paged_decode", counted)
    with_kernel = [attend(2), attend(8)]  # decodes alone, then beside a prefill
    assert len(calls) == 2
    decode_kernel.set_enabled(False)
    try:
        without = [attend(2), attend(8)]
    finally:
        decode_kernel.set_enabled(True)
    assert len(calls) == 2  # the torch path ran
    for got, want in zip(with_kernel, without, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-2)
    assert torch.equal(with_kernel[0], with_kernel[1][:2])  # alone == beside a prefill
