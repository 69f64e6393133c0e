"""The graph-safe decode path, run eagerly on the CPU (capture itself needs CUDA: tests/gpu):
bucketing, and the static-buffer attention equal to the torch backend with padding rows that
write only the scratch block."""

from __future__ import annotations

import torch

from stage_worker.attention import SeqSlice, make_backend
from stage_worker.attention.base import AttentionMetadata, build_metadata
from stage_worker.cuda_graphs import MAX_TABLE_BLOCKS, StaticDecodeAttention, bucket_of

BS = 16


def decodes(context_lens: list[int]) -> list[SeqSlice]:
    seqs, next_block = [], 0
    for i, n in enumerate(context_lens):
        blocks = -(-n // BS)
        seqs.append(SeqSlice(i, 1, n, tuple(range(next_block, next_block + blocks))))
        next_block += blocks
    return seqs


def test_buckets_pad_the_batch_to_a_power_of_two_and_the_table_by_at_most_half() -> None:
    assert bucket_of(decodes([5]), BS) == (1, 16)
    assert bucket_of(decodes([5, 300, 17]), BS) == (4, 24)  # 300 tokens: 19 blocks -> 24
    assert bucket_of(decodes([513] * 32), BS) == (32, 48)  # 33 blocks: 48, not 64
    for blocks in range(1, MAX_TABLE_BLOCKS + 1):
        _, table = bucket_of(decodes([blocks * BS]), BS) or (0, 0)
        assert blocks <= table <= max(16, 1.5 * blocks), blocks
    assert bucket_of(decodes([1] * 33), BS) == (64, 16)
    assert bucket_of(decodes([1] * 257), BS) is None  # beyond the largest batch bucket
    assert bucket_of(decodes([MAX_TABLE_BLOCKS * BS + 1]), BS) is None
    prefill = [SeqSlice(0, 7, 7, (0,))]
    assert bucket_of(prefill, BS) is None and bucket_of([], BS) is None


def test_static_attention_equals_the_torch_backend_and_pads_into_scratch() -> None:
    lens = [9, 40, 1, 33]
    seqs = decodes(lens)
    batch, table, heads, kv_heads, dim = 8, 4, 4, 2, 8
    num_blocks = sum(-(-n // BS) for n in lens)
    scratch = num_blocks
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks + 1, BS, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks + 1, BS, kv_heads, dim, generator=gen)
    q = torch.randn(batch, heads, dim, generator=gen)
    k, v = torch.randn(batch, kv_heads, dim, generator=gen), torch.randn(batch, kv_heads, dim)

    meta = build_metadata(seqs, BS, "cpu")
    ref_backend = make_backend("torch", "cpu")
    ref_backend.prepare(meta, heads, kv_heads, dim)
    kc, vc = k_cache.clone(), v_cache.clone()
    expected = ref_backend.forward(q[:4], k[:4], v[:4], kc, vc, meta)

    static = StaticDecodeAttention(batch, table, BS, "cpu")
    static.load(seqs, scratch)
    assert static.block_table[4:].eq(scratch).all() and static.context_lens[4:].eq(1).all()
    slots = torch.cat([meta.slot_mapping, torch.full((batch - 4,), scratch * BS)])
    padded_meta = AttentionMetadata([], torch.zeros(batch, dtype=torch.int64), slots, BS)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    static.prepare(padded_meta, heads, kv_heads, dim)
    got = static.forward(q, k, v, kc2, vc2, padded_meta)
    torch.testing.assert_close(got[:4], expected)
    # every block but the scratch one ends as the torch backend left it
    torch.testing.assert_close(kc2[:scratch], kc[:scratch])
    torch.testing.assert_close(vc2[:scratch], vc[:scratch])
    assert torch.isfinite(got).all()  # padding rows attend to one slot: no NaN
