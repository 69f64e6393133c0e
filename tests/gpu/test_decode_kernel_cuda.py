"""The Triton decode attention (attention/triton_decode.py) against torch's paged_decode on the
GPU: scattered blocks, ragged contexts (padding rows of one token among them), grouped, multi-
query and one-to-one heads, one program per context and contexts split across programs.

Tolerance: the reference attends in float32 over the same cache values. A float32 kernel
differs only in summation order (rel 1e-5); bf16 rounds its probabilities to bf16 before the
value product as torch's bf16 path does, so it is held to 1e-2 of the output's norm."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from stage_worker.attention.base import write_kv
from stage_worker.attention.torch_backend import paged_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]

BLOCK_SIZE = 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim", "lens", "table", "splits"),
    [
        (32, 8, 128, [513, 1, 17, 96, 700], 48, 1),  # Mistral-7B's heads, a padding row
        (32, 8, 128, [3000, 2, 4096], 256, 2),  # long contexts split in two
        (8, 1, 64, [65, 128, 1, 250], 16, 3),  # multi-query, three splits
        (4, 4, 16, [37, 64], 4, 1),  # one KV head per query head
    ],
)
def test_decode_kernel_matches_torch_and_writes_the_cache(
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    lens: list[int],
    table: int,
    splits: int,
    dtype: torch.dtype,
) -> None:
    from stage_worker.attention import triton_decode

    device, batch = "cuda", len(lens)
    gen = torch.Generator(device=device).manual_seed(7)
    num_blocks = batch * table + 1
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    # every sequence on scattered blocks; block 0 stays out of every table
    blocks = torch.randperm(num_blocks - 1, generator=gen, device=device)[: batch * table] + 1
    block_table = blocks.view(batch, table)
    context_lens = torch.tensor(lens, device=device)
    slots = torch.stack(
        [block_table[b, (n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
         for b, n in enumerate(lens)]
    )  # fmt: skip
    qkv = torch.randn(batch, q_heads + 2 * kv_heads, head_dim, generator=gen, device=device)
    q, k, v = qkv.to(dtype).split([q_heads, kv_heads, kv_heads], dim=1)  # strided, as a layer's
    ours_k, ours_v = k_cache.clone(), v_cache.clone()
    scratch = triton_decode.DecodeScratch(
        batch, kv_heads, q_heads // kv_heads, head_dim, splits, device
    )
    out = triton_decode.paged_decode_write(
        q, k, v, ours_k, ours_v, block_table, context_lens, slots, scratch
    )

    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(ours_k, k_cache) and torch.equal(ours_v, v_cache)
    max_len = table * BLOCK_SIZE
    mask = (torch.arange(max_len, device=device)[None, :] < context_lens[:, None])[:, None, None]
    ref = paged_decode(
        q.float(), k_cache.float(), v_cache.float(), block_table.flatten(), max_len, mask
    )
    assert out.shape == (batch, q_heads, head_dim) and out.dtype == dtype
    error = ((out.float() - ref).norm() / ref.norm()).item()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error


def test_graph_steps_take_the_kernel_and_the_switch_turns_it_off() -> None:
    """StaticDecodeAttention attends with the kernel on CUDA by default, with torch's
    paged_decode when the decode kernel is off."""
    from stage_worker.attention.base import AttentionMetadata
    from stage_worker.cuda_graphs import StaticDecodeAttention
    from stage_worker.layers import fused

    def meta() -> AttentionMetadata:
        return AttentionMetadata([], torch.zeros(2), torch.zeros(2), BLOCK_SIZE, torch.bfloat16)

    on = StaticDecodeAttention(2, 16, BLOCK_SIZE, "cuda")
    on.prepare(meta(), 32, 8, 128)
    fused.set_decode_kernel_enabled(False)
    try:
        off = StaticDecodeAttention(2, 16, BLOCK_SIZE, "cuda")
        off.prepare(meta(), 32, 8, 128)
    finally:
        fused.set_decode_kernel_enabled(True)
    assert on._scratch is not None and off._scratch is None


def test_forced_splits_reach_the_graphs_captured_after() -> None:
    """`bench stage --decode-splits` splits every context as asked, and only 0 to 16 ways."""
    from stage_worker.attention import triton_decode
    from stage_worker.attention.base import AttentionMetadata
    from stage_worker.cuda_graphs import StaticDecodeAttention

    meta = AttentionMetadata([], torch.zeros(1), torch.zeros(1), BLOCK_SIZE, torch.bfloat16)
    with pytest.raises(ValueError, match="splits=17"):
        triton_decode.force_splits(17)
    triton_decode.force_splits(4)
    try:
        attention = StaticDecodeAttention(1, 48, BLOCK_SIZE, "cuda")
        attention.prepare(meta, 32, 8, 128)
    finally:
        triton_decode.force_splits(0)
    assert attention._scratch is not None and attention._scratch.splits == 4
    assert triton_decode.num_splits(48 * BLOCK_SIZE) == 1
