"""The flashinfer backend against the torch reference on the GPU, over a paged KV cache with
scattered blocks and ragged lengths: prefill chunks (first and later), decodes, and both mixed.

Tolerance: bf16 inputs, float32 accumulation in both backends; the outputs differ by the
rounding of bf16 intermediates (probabilities cast to bf16 before the value product in torch,
inside the kernel in flashinfer): atol = rtol = 2e-2, about 3 bf16 ulps at the outputs' scale."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from stage_worker.attention import SeqSlice, make_backend
from stage_worker.attention.base import build_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]

BLOCK_SIZE = 16
BATCHES = {
    # (tokens already cached, new tokens) per sequence
    "prefill": [(0, 23), (40, 17), (0, 130), (31, 64)],
    "decode": [(70, 1), (5, 1), (129, 1), (0, 1), (511, 1), (16, 1)],
    "mixed": [(0, 23), (40, 17), (70, 1), (5, 1), (129, 1)],
}


def ragged_batch(lengths: list[tuple[int, int]]) -> list[SeqSlice]:
    """The sequences one after another in the step, each on non-contiguous blocks."""
    seqs, start, next_block = [], 0, 3
    for cached, new in lengths:
        num_blocks = -(-(cached + new) // BLOCK_SIZE)
        blocks = tuple(range(next_block, next_block + 2 * num_blocks, 2))
        next_block += 2 * num_blocks + 1
        seqs.append(SeqSlice(start, new, cached + new, blocks))
        start += new
    return seqs


@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(8, 8), (8, 2), (32, 8)])
def test_flashinfer_matches_torch(kind: str, q_heads: int, kv_heads: int) -> None:
    device, dtype, head_dim = "cuda", torch.bfloat16, 128
    seqs = ragged_batch(BATCHES[kind])
    num_tokens = sum(s.num_tokens for s in seqs)
    num_blocks = 2 * sum(-(-s.context_len // BLOCK_SIZE) for s in seqs) + 8
    gen = torch.Generator(device=device).manual_seed(100 * list(BATCHES).index(kind) + q_heads)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)  # earlier tokens: random
    q = rand(num_tokens, q_heads, head_dim)
    k, v = rand(num_tokens, kv_heads, head_dim), rand(num_tokens, kv_heads, head_dim)
    outs, caches = [], []
    for name in ("torch", "flashinfer"):
        backend = make_backend(name, device)
        meta = build_metadata(seqs, BLOCK_SIZE, device)
        meta.extra["dtype"] = dtype
        backend.prepare(meta, q_heads, kv_heads, head_dim)
        kc, vc = k_cache.clone(), v_cache.clone()
        out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
        out.copy_(backend.forward(q, k, v, kc, vc, meta))
        outs.append(out.float())
        caches.append((kc, vc))
    assert not outs[1].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
    # both wrote the new tokens' K and V to the same slots
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
