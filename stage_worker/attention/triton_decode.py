"""Paged decode attention in one Triton kernel, for the decode steps CUDA graphs replay.

Why: the torch path (torch_backend.paged_decode) attends a decode batch with about a dozen
kernels a layer (the cache write, two block gathers, two matmuls, casts, the mask, softmax). At
batch 1 on an H200 each is a microsecond or two of work plus its gap in the graph, and 32 layers
of them cost a 7B model's decode step a third of its weight-reading time (BENCHMARKS.md, GPU
section). Here one kernel writes the step's K and V into the cache and attends; a second one
merges the partial results only where a long context is split across programs.

One program per (sequence, KV head, split): the query heads that share the KV head are the rows
of a [GROUP_PAD, D] tile (padded to 16, the smallest matrix-unit tile), so each key and value row
is read once for all of them. A split walks its share of the sequence's cached positions in
BLOCK_N-token tiles with an online softmax. The step's own token is never read back from the
cache: split 0 starts from its score, so the write and the reads never touch the same slot.

Imported only on CUDA (Triton ships with torch's CUDA builds, not its CPU ones).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64
"""Cached positions per tile of a split's loop."""
TOKENS_PER_SPLIT = 2048
"""A context longer than this is split across programs (flash-decoding), at most MAX_SPLITS."""
MAX_SPLITS = 16


_forced_splits = 0


def force_splits(splits: int) -> None:
    """Every graph captured from now on splits each context `splits` ways (0: num_splits's rule
    by context length). For `bench stage --decode-splits`: at batch 1 the kernel is 8 programs on
    a 132-SM H200 (BENCHMARKS, "Third GPU session"), so the rule should weigh the batch too once
    measured."""
    global _forced_splits
    if not 0 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits={splits}: 0 (the rule) to {MAX_SPLITS}")
    _forced_splits = splits


def num_splits(max_context_tokens: int) -> int:
    """Programs that share one sequence's context: one up to TOKENS_PER_SPLIT positions."""
    if _forced_splits:
        return _forced_splits
    return max(1, min(MAX_SPLITS, -(-max_context_tokens // TOKENS_PER_SPLIT)))


def takes_heads(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Shapes and dtypes the kernel handles: a power-of-two head_dim of 16 to 256, whole groups
    of query heads per KV head, and bf16, fp16 or fp32 (the cache in the model's dtype)."""
    return (
        dtype in (torch.bfloat16, torch.float16, torch.float32)
        and num_q_heads % num_kv_heads == 0
        and 16 <= head_dim <= 256
        and head_dim & (head_dim - 1) == 0
    )


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, table_ptr, lens_ptr, slots_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    q_stride_b, q_stride_h, k_stride_b, k_stride_h, v_stride_b, v_stride_h, table_stride,
    scale, split_tokens,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = tl.arange(0, HEAD_DIM)
    g = tl.arange(0, GROUP_PAD)
    rows = g < GROUP
    q_heads = h * GROUP + g
    q = tl.load(  # [GROUP_PAD, D]
        q_ptr + b * q_stride_b + q_heads[:, None] * q_stride_h + d[None, :],
        mask=rows[:, None], other=0.0,
    )  # fmt: skip
    k_new = tl.load(k_ptr + b * k_stride_b + h * k_stride_h + d)  # [D]
    v_new = tl.load(v_ptr + b * v_stride_b + h * v_stride_h + d)
    slot_stride = KV_HEADS * HEAD_DIM  # one cache slot: [KV_HEADS, D]
    if split == 0:  # the step's own token goes into the cache once
        slot = tl.load(slots_ptr + b)
        tl.store(k_cache_ptr + slot * slot_stride + h * HEAD_DIM + d, k_new)
        tl.store(v_cache_ptr + slot * slot_stride + h * HEAD_DIM + d, v_new)
        # its score starts split 0's softmax: m = that score, l = 1, acc = its value row
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        m = s_new
        l_sum = tl.full([GROUP_PAD], 1.0, tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32) + v_new.to(tl.float32)[None, :]
    else:
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    cached = tl.load(lens_ptr + b) - 1  # positions before the step's token
    start = split * split_tokens
    stop = tl.minimum(start + split_tokens, cached)
    for tile in range(start, stop, BLOCK_N):
        t = tile + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions
        valid = t < stop
        block = tl.load(table_ptr + b * table_stride + t // BLOCK_SIZE, mask=valid, other=0)
        at = (block * BLOCK_SIZE + t % BLOCK_SIZE) * slot_stride + h * HEAD_DIM
        keys = tl.load(k_cache_ptr + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale  # [GP, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        values = tl.load(v_cache_ptr + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
        m = m_new
    if SPLITS == 1:
        out = acc / l_sum[:, None]
        dst = out_ptr + (b * KV_HEADS * GROUP + q_heads)[:, None] * HEAD_DIM + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=rows[:, None])
    else:  # partial results [B, KV_HEADS, SPLITS, GROUP_PAD] (and x D), merged below
        part = ((b * KV_HEADS + h) * SPLITS + split) * GROUP_PAD + g
        tl.store(part_m_ptr + part, m)
        tl.store(part_l_ptr + part, l_sum)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc)


@triton.jit
def _merge_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    # one program per (sequence, KV head): the splits' softmax states rescaled to a common max
    b, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    g = tl.arange(0, GROUP_PAD)
    base = (b * KV_HEADS + h) * SPLITS * GROUP_PAD
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for split in range(SPLITS):
        m = tl.maximum(m, tl.load(part_m_ptr + base + split * GROUP_PAD + g))
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for split in range(SPLITS):
        part = base + split * GROUP_PAD + g
        weight = tl.exp(tl.load(part_m_ptr + part) - m)  # 0 for a split with no positions
        l_sum += weight * tl.load(part_l_ptr + part)
        acc += weight[:, None] * tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :])
    q_heads = h * GROUP + g
    dst = out_ptr + (b * KV_HEADS * GROUP + q_heads)[:, None] * HEAD_DIM + d[None, :]
    tl.store(dst, (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])


class DecodeScratch:
    """The split programs' partial results for one (batch, heads, splits) shape: allocated once
    and reused by every layer and replay (a graph reads fixed addresses). Float32 [B, Hkv,
    splits, GROUP_PAD, D] when splits > 1: 134 MB for a batch of 256 over 16k-token tables with
    8 KV heads of 128; nothing to speak of otherwise."""

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        group: int,
        head_dim: int,
        splits: int,
        device: torch.device | str,
    ) -> None:
        self.group_pad = max(16, triton.next_power_of_2(group))
        self.splits = splits
        rows = batch * kv_heads * splits * self.group_pad if splits > 1 else 1
        self.m = torch.empty(rows, dtype=torch.float32, device=device)
        self.l_sum = torch.empty(rows, dtype=torch.float32, device=device)
        self.acc = torch.empty(rows * (head_dim if splits > 1 else 1), dtype=torch.float32,
                               device=device)  # fmt: skip


def paged_decode_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    slots: torch.Tensor,
    scratch: DecodeScratch,
) -> torch.Tensor:
    """Writes each sequence's new k, v at its slot and attends its context (context_lens counts
    the new token). q: [B, Hq, D]; k, v: [B, Hkv, D] (each head's D contiguous); caches:
    [num_blocks, block_size, Hkv, D] contiguous; block_table: [B, M]; context_lens, slots: [B]
    -> [B, Hq, D]."""
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("paged_decode_write: each head's D must be contiguous in q, k and v")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != q.dtype:
        raise ValueError(f"paged_decode_write: contiguous caches of q's dtype {q.dtype}")
    out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    splits = scratch.splits
    max_tokens = block_table.shape[1] * block_size
    split_tokens = -(-max_tokens // splits)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs
    _decode_kernel[(batch, kv_heads, splits)](
        q, k, v, k_cache, v_cache, block_table, context_lens, slots,
        out, scratch.m, scratch.l_sum, scratch.acc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        block_table.stride(0), head_dim**-0.5, split_tokens,
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=scratch.group_pad, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, SPLITS=splits, PRECISION=precision,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(batch, kv_heads)](
            out, scratch.m, scratch.l_sum, scratch.acc,
            KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=scratch.group_pad, HEAD_DIM=head_dim,
            SPLITS=splits,
        )  # fmt: skip
    return out
