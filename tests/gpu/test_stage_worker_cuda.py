"""On CUDA: the flashinfer attention backend against the torch reference on the same ragged batch
(prefill chunks over cached context mixed with decodes), and a two-stage pipeline on the GPU
against transformers. Skipped without CUDA (the flashinfer test also without flashinfer)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from stage_worker.attention import SeqSlice, make_backend
from stage_worker.attention.base import build_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BLOCK_SIZE = 16


def ragged_batch(device: str) -> list[SeqSlice]:
    """Two prefill chunks (one over 40 cached tokens), three decodes; scattered block ids."""
    lengths = [(0, 23), (40, 17), (70, 1), (5, 1), (129, 1)]  # (cached tokens, new tokens)
    seqs, start, next_block = [], 0, 3
    for cached, new in lengths:
        num_blocks = -(-(cached + new) // BLOCK_SIZE)
        blocks = tuple(range(next_block, next_block + 2 * num_blocks, 2))  # non-contiguous
        next_block += 2 * num_blocks + 1
        seqs.append(SeqSlice(start, new, cached + new, blocks))
        start += new
    return seqs


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(8, 8), (8, 2), (32, 8)])
def test_flashinfer_matches_torch_on_a_mixed_batch(q_heads: int, kv_heads: int) -> None:
    device, dtype, head_dim = "cuda", torch.bfloat16, 128
    seqs = ragged_batch(device)
    num_tokens = sum(s.num_tokens for s in seqs)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    cache_shape = (64, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)  # earlier tokens: random
    q = rand(num_tokens, q_heads, head_dim)
    k, v = rand(num_tokens, kv_heads, head_dim), rand(num_tokens, kv_heads, head_dim)
    outs = []
    for name in ("torch", "flashinfer"):
        backend = make_backend(name, device)
        meta = build_metadata(seqs, BLOCK_SIZE, device)
        meta.extra["dtype"] = dtype
        backend.prepare(meta, q_heads, kv_heads, head_dim)
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(backend.forward(q, k, v, kc, vc, meta).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


def test_float32_pipeline_on_cuda_matches_transformers(tmp_path: Path) -> None:
    from tests.unit.stage_worker.inprocess import generate, make_runners
    from tests.unit.stage_worker.tiny_models import load_oracle, make_checkpoint, oracle_greedy

    model_dir = make_checkpoint("llama", tmp_path / "llama")
    prompt = [(3 * j + 1) % 251 for j in range(33)]
    runners = make_runners(model_dir, 2, num_blocks=16, device="cuda")
    out = generate(runners, [prompt], 4)
    assert out.tokens[0] == oracle_greedy(load_oracle(model_dir), prompt, 4)
