"""The plain-torch attention path (every device without the CPU kernel: CUDA, float16) against
attention written out densely: prompts' first chunks, later chunks over their cached positions,
decodes, and all of them in one step, over scattered cache blocks."""

from __future__ import annotations

import pytest
import torch

from stage_worker.attention import SeqSlice
from stage_worker.attention.base import build_metadata
from stage_worker.attention.torch_backend import TorchAttention, _context_slots

BLOCK_SIZE = 4
HQ, HKV, D = 8, 2, 16


def dense_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_position: int
) -> torch.Tensor:
    """q: [n, Hq, D] at positions first_position.. over keys, values: [L, Hkv, D] -> [n, Hq, D],
    in float64 with an explicit causal mask."""
    n, length = q.shape[0], keys.shape[0]
    k = keys.double().repeat_interleave(HQ // HKV, dim=1)  # [L, Hq, D]
    v = values.double().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * D**-0.5
    seen = (
        torch.arange(length)[None, :] <= torch.arange(first_position, first_position + n)[:, None]
    )
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v)


def scattered(lengths: list[tuple[int, int]]) -> list[SeqSlice]:
    """(cached, new) per sequence, one after another in the step, on every other block."""
    seqs, start, block = [], 0, 1
    for cached, new in lengths:
        blocks = tuple(range(block, block + 2 * -(-(cached + new) // BLOCK_SIZE), 2))
        block = blocks[-1] + 3
        seqs.append(SeqSlice(start, new, cached + new, blocks))
        start += new
    return seqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lengths",
    [
        [(0, 13)],  # a prompt's first chunk
        [(21, 7)],  # a later chunk: 7 new positions after 21 cached
        [(9, 1), (30, 1), (2, 1)],  # decodes of unequal contexts
        [(0, 5), (17, 6), (40, 1), (3, 1)],  # a hybrid step
    ],
)
def test_the_torch_path_equals_dense_attention(
    lengths: list[tuple[int, int]], dtype: torch.dtype
) -> None:
    seqs = scattered(lengths)
    num_tokens = sum(s.num_tokens for s in seqs)
    num_blocks = max(b for s in seqs for b in s.block_ids) + 2
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, generator=gen).to(dtype)
    q = torch.randn(num_tokens, HQ, D, generator=gen).to(dtype)
    k = torch.randn(num_tokens, HKV, D, generator=gen).to(dtype)
    v = torch.randn(num_tokens, HKV, D, generator=gen).to(dtype)
    meta = build_metadata(seqs, BLOCK_SIZE, "cpu")
    meta.dtype = dtype
    # not prepared for the CPU kernel: forward takes the torch path
    out = TorchAttention().forward(q, k, v, k_cache, v_cache, meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for s in seqs:
        slots = torch.from_numpy(_context_slots(s.block_ids, s.context_len, BLOCK_SIZE))
        keys = k_cache.view(-1, HKV, D)[slots]  # the step's keys written in already
        values = v_cache.view(-1, HKV, D)[slots]
        rows = slice(s.query_start, s.query_start + s.num_tokens)
        want = dense_attention(q[rows], keys, values, s.first_position)
        torch.testing.assert_close(out[rows].double(), want, atol=tol, rtol=tol)


def test_context_slots_follow_the_block_table() -> None:
    # blocks 5 and 2 of 4 slots each: positions 0..3 in block 5, 4..5 in block 2
    assert _context_slots((5, 2, 9), 6, 4).tolist() == [20, 21, 22, 23, 8, 9]
