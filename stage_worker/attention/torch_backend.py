"""Attention without a GPU library. On CPUs with AVX-512 (bf16 dot products), and for float32
caches on CPUs with AVX2 and FMA, the whole step runs on the C kernel (cpu_kernel.py): every
token, prompt or decode, against its own paged context in one call per layer. Elsewhere, plain
torch (any device): prefill chunks one by one through SDPA, all one-token chunks (decodes)
together as one padded batch of matmuls (paged_decode)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from stage_worker.attention import cpu_kernel
from stage_worker.attention.base import AttentionMetadata, write_kv


@dataclass
class _Prefill:
    query_start: int
    num_tokens: int
    context_slots: torch.Tensor  # [context_len] flat cache slots
    mask: torch.Tensor | None  # [num_tokens, context_len] True = attend; None = plain causal


@dataclass
class _Decodes:
    rows: torch.Tensor  # [batch] index of each decode token in the step
    only_decodes: bool  # the step is these decodes alone, in order: rows == arange(batch)
    block_table: torch.Tensor  # [batch * max_blocks] (padded with block 0), flattened
    max_context_len: int
    mask: torch.Tensor | None  # [batch, 1, 1, max_context_len] True = attend; None: all valid

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [batch, Hq, D] -> [batch, Hq, D]."""
        return paged_decode(q, k_cache, v_cache, self.block_table, self.max_context_len, self.mask)


@dataclass
class KernelStep:
    """The step for the CPU kernel: one row per query token."""

    block_table: torch.Tensor  # [T, max_blocks] int64: the table of each token's sequence
    context_lens: torch.Tensor  # [T] int64: positions each token attends
    scratch: torch.Tensor  # float32, cpu_kernel.scratch_floats() for `threads` threads
    threads: int  # the worker's torch threads when the step was prepared


def _kernel_step(meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int) -> KernelStep:
    """Per-token tables and context lengths, built with numpy: a chunk's tokens repeat its
    sequence's table and attend first_position + 1, + 2, ... positions (the causal mask)."""
    seqs, bs = meta.seqs, meta.block_size
    used = [-(-s.context_len // bs) for s in seqs]
    tables = np.zeros((len(seqs), max(used)), dtype=np.int64)
    for row, (s, n) in enumerate(zip(seqs, used, strict=True)):
        tables[row, :n] = s.block_ids[:n]
    counts = np.fromiter((s.num_tokens for s in seqs), np.int64, len(seqs))
    # token t of a chunk starting at row q0 and position p0 attends p0 + (t - q0) + 1 positions
    q0_minus_p0 = np.fromiter((s.query_start - s.first_position for s in seqs), np.int64)
    lens = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(q0_minus_p0, counts) + 1
    max_len = max(s.context_len for s in seqs)
    threads = torch.get_num_threads()
    return KernelStep(
        torch.from_numpy(np.repeat(tables, counts, axis=0)),
        torch.from_numpy(lens),
        torch.empty(cpu_kernel.scratch_floats(num_q_heads, num_kv_heads, max_len, threads)),
        threads,
    )


def _context_slots(block_ids: tuple[int, ...], context_len: int, block_size: int) -> np.ndarray:
    """The flat cache slot of each of a sequence's first context_len positions: [context_len]."""
    num_blocks = -(-context_len // block_size)
    assert len(block_ids) >= num_blocks, f"{len(block_ids)} blocks for {context_len} positions"
    blocks = np.asarray(block_ids[:num_blocks], dtype=np.int64)
    return (blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)[:context_len]


class TorchAttention:
    def prepare(
        self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        on_cpu = meta.positions.device.type == "cpu"
        dtype = meta.dtype or torch.float32
        if (
            on_cpu
            and meta.seqs
            and cpu_kernel.takes_heads(num_q_heads, num_kv_heads, head_dim, dtype)
        ):
            meta.extra["cpu_kernel"] = _kernel_step(meta, num_q_heads, num_kv_heads)
        else:
            _prepare_torch(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        step = meta.extra.get("cpu_kernel")
        # a step prepared for the kernel (on the CPU, heads it takes, the kernel available)
        if isinstance(step, KernelStep) and cpu_kernel.takes_tensors(q, k_cache):
            return cpu_kernel.attend(
                q, k_cache, v_cache, step.block_table, step.context_lens, step.scratch, step.threads
            )
        if "torch_prefills" not in meta.extra:  # a dtype the kernel does not take (float16)
            _prepare_torch(meta)
        return _attend_torch(q, k_cache, v_cache, meta)


def _prepare_torch(meta: AttentionMetadata) -> None:
    """The torch path's per-step state: each prefill chunk's slots and mask, the decodes'
    padded block table."""
    device, bs = meta.positions.device, meta.block_size
    prefills: list[_Prefill] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    for s in meta.seqs:
        if s.num_tokens == 1:
            decode_rows.append(s.query_start)
            decode_tables.append(list(s.block_ids[: -(-s.context_len // bs)]))
            decode_lens.append(s.context_len)
            continue
        slots = torch.from_numpy(_context_slots(s.block_ids, s.context_len, bs)).to(device)
        mask = None
        if s.first_position > 0:
            # query i sits at position first_position + i and sees keys up to it
            q_pos = torch.arange(s.first_position, s.context_len, device=device)
            mask = torch.arange(s.context_len, device=device)[None, :] <= q_pos[:, None]
        prefills.append(_Prefill(s.query_start, s.num_tokens, slots, mask))
    meta.extra["torch_prefills"] = prefills
    meta.extra["torch_decodes"] = None
    if not decode_rows:
        return
    # Whole blocks are gathered (fewer index entries than per-token slots); positions past a
    # sequence's context are masked, or cut off when every context is as long.
    max_len = max(decode_lens)
    max_blocks = max(len(t) for t in decode_tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
    mask = None
    if min(decode_lens) != max_len:
        lens = torch.tensor(decode_lens, device=device)
        mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None, :]
    meta.extra["torch_decodes"] = _Decodes(
        torch.tensor(decode_rows, device=device),
        not prefills and decode_rows == list(range(len(decode_rows))),
        torch.tensor(padded, device=device).flatten(),
        max_len,
        mask,
    )


def _attend_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q: [T, Hq, D] over the caches ([num_blocks, block_size, Hkv, D], this step's keys and
    values already written) -> [T, Hq, D]."""
    decodes: _Decodes | None = meta.extra["torch_decodes"]  # type: ignore[assignment]
    if decodes is not None and decodes.only_decodes:
        # a decode-only step (the common one) needs no scatter into a fresh output
        return decodes.attend(q, k_cache, v_cache)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, Hkv, D]
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty_like(q)
    prefills: list[_Prefill] = meta.extra["torch_prefills"]  # type: ignore[assignment]
    for p in prefills:
        rows = slice(p.query_start, p.query_start + p.num_tokens)
        # 4-D [1, heads, tokens, D]: with 3-D inputs CPU SDPA falls back to the math kernel,
        # which materializes every score (8x slower at 1024 tokens)
        qi = q[rows].transpose(0, 1)[None]  # [1, Hq, n, D]
        ki = flat_k[p.context_slots].transpose(0, 1)[None]  # [1, Hkv, L, D]
        vi = flat_v[p.context_slots].transpose(0, 1)[None]
        oi = sdpa(qi, ki, vi, attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True)
        out[rows] = oi[0].transpose(0, 1)
    if decodes is not None:
        out[decodes.rows] = decodes.attend(q[decodes.rows], k_cache, v_cache)
    return out


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One query per sequence over its cached context, as plain matmuls: cheaper than a fused
    kernel's set-up at this size, and free of host synchronization (CUDA graphs capture it).
    q: [B, Hq, D]; block_table: [B * max_blocks] flattened, padded; mask:
    [B, 1, 1, max_context_len] True = attend, or None when every context is max_context_len
    long -> [B, Hq, D]."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    # index_select of whole blocks (cheaper than advanced indexing with a 2-D table):
    # [B * max_blocks, block_size, Hkv, D] -> [B, max_blocks * block_size, Hkv, D]
    k = k_cache.index_select(0, block_table).view(batch, -1, num_kv_heads, head_dim)
    v = v_cache.index_select(0, block_table).view(batch, -1, num_kv_heads, head_dim)
    # -> [B, Hkv, L, D]
    k = k[:, :max_context_len].permute(0, 2, 1, 3)
    v = v[:, :max_context_len].permute(0, 2, 1, 3)
    qg = q.view(batch, num_kv_heads, group, head_dim)  # query heads grouped by KV head
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * head_dim**-0.5  # [B, Hkv, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(batch, num_q_heads, head_dim)
