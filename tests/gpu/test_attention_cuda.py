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
from stage_worker.attention.base import AttentionMetadata, build_metadata

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
        meta.dtype = dtype
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


def test_flashinfer_graph_decode_equals_eager_on_every_replay() -> None:
    """One graph captured for a batch of 8 decodes, replayed over steps of other sizes and
    lengths (short, long, past the capture's, a full batch): each replay's output equals the
    eager flashinfer backend's on the same inputs, and the new K and V land in the same slots."""
    from stage_worker.attention.flashinfer_backend import WORKSPACE_BYTES, FlashInferGraphDecode
    from stage_worker.cuda_graphs import MAX_TABLE_BLOCKS

    device, dtype, q_heads, kv_heads, head_dim, batch = "cuda", torch.bfloat16, 32, 8, 128, 8
    num_blocks = 700
    scratch = num_blocks - 1
    gen = torch.Generator(device=device).manual_seed(7)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)
    q, k, v = (
        rand(batch, q_heads, head_dim),
        rand(batch, kv_heads, head_dim),
        rand(batch, kv_heads, head_dim),
    )
    slots = torch.full((batch,), scratch * BLOCK_SIZE, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        [], torch.zeros(batch, dtype=torch.int64, device=device), slots, BLOCK_SIZE
    )
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    attention = FlashInferGraphDecode(
        workspace, batch, MAX_TABLE_BLOCKS, (q_heads, kv_heads, head_dim), BLOCK_SIZE, dtype
    )
    attention.load([], scratch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention.forward(q, k, v, k_cache, v_cache, meta)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.forward(q, k, v, k_cache, v_cache, meta)

    steps = [
        [(70, 1), (5, 1), (129, 1)],
        [(511, 1)] * batch,
        [(0, 1), (16, 1), (2000, 1), (33, 1), (2, 1)],
        [(1, 1)],
    ]
    for lengths in steps:
        seqs = ragged_batch(lengths)
        n = len(seqs)
        eager_meta = build_metadata(seqs, BLOCK_SIZE, device)
        eager_meta.dtype = dtype
        q[:n], k[:n], v[:n] = (
            rand(n, q_heads, head_dim),
            rand(n, kv_heads, head_dim),
            rand(n, kv_heads, head_dim),
        )
        slots[:n] = eager_meta.slot_mapping
        slots[n:] = scratch * BLOCK_SIZE
        kc, vc = k_cache.clone(), v_cache.clone()  # the eager run starts where the replay does
        attention.load(seqs, scratch)
        out.fill_(float("nan"))
        graph.replay()
        eager = make_backend("flashinfer", device)
        eager.prepare(eager_meta, q_heads, kv_heads, head_dim)
        expected = eager.forward(q[:n], k[:n], v[:n], kc, vc, eager_meta)
        assert not out[:n].isnan().any(), lengths
        torch.testing.assert_close(out[:n].float(), expected.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(k_cache[:scratch], kc[:scratch]), lengths  # same slots written
        assert torch.equal(v_cache[:scratch], vc[:scratch]), lengths
