"""A prompt's later chunk through the torch attention path on CUDA, in bf16 with grouped KV
heads over scattered cache blocks, equals attention written out densely."""

from __future__ import annotations

import pytest
import torch

from stage_worker.attention import SeqSlice
from stage_worker.attention.base import build_metadata
from stage_worker.attention.torch_backend import TorchAttention, _context_slots

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BLOCK_SIZE = 16
HQ, HKV, D = 32, 8, 128  # Mistral-7B's heads


@pytest.mark.parametrize(("cached", "chunk"), [(0, 512), (3000, 512), (1000, 37)])
def test_a_later_chunk_equals_dense_attention(cached: int, chunk: int) -> None:
    device, dtype = "cuda", torch.bfloat16
    length = cached + chunk
    blocks = tuple(range(5, 5 + 2 * -(-length // BLOCK_SIZE), 2))  # every other block
    seqs = [SeqSlice(0, chunk, length, blocks)]
    gen = torch.Generator(device=device).manual_seed(cached + chunk)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    k_cache, v_cache = (
        rand(blocks[-1] + 1, BLOCK_SIZE, HKV, D),
        rand(blocks[-1] + 1, BLOCK_SIZE, HKV, D),
    )
    q, k, v = rand(chunk, HQ, D), rand(chunk, HKV, D), rand(chunk, HKV, D)
    meta = build_metadata(seqs, BLOCK_SIZE, device)
    meta.dtype = dtype
    backend = TorchAttention()
    backend.prepare(meta, HQ, HKV, D)
    out = backend.forward(q, k, v, k_cache, v_cache, meta)

    slots = torch.from_numpy(_context_slots(blocks, length, BLOCK_SIZE)).to(device)
    keys = k_cache.view(-1, HKV, D)[slots].float().repeat_interleave(HQ // HKV, dim=1)
    values = v_cache.view(-1, HKV, D)[slots].float().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * D**-0.5
    seen = (
        torch.arange(length, device=device)[None, :]
        <= torch.arange(cached, length, device=device)[:, None]
    )
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    want = torch.einsum("hnl,lhd->nhd", probs, values)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
