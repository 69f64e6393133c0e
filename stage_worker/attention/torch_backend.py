"""Attention in plain torch (any device): prefill chunks one by one, all one-token chunks
(decodes) together as one batch: on CPUs with AVX-512 through the C decode kernel
(decode_kernel.py), elsewhere as one padded batch of matmuls (paged_decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from stage_worker.attention import decode_kernel
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
    block_table: torch.Tensor  # [batch, max_blocks] (padded with block 0)
    context_lens: torch.Tensor  # [batch] int64
    max_context_len: int
    mask: torch.Tensor | None  # [batch, 1, 1, max_context_len] True = attend; None: all valid
    scratch: torch.Tensor | None  # float32 for the C kernel (CPU only)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [batch, Hq, D] -> [batch, Hq, D]."""
        if self.scratch is not None and decode_kernel.usable(q, k_cache):
            return decode_kernel.paged_decode(
                q, k_cache, v_cache, self.block_table, self.context_lens, self.scratch
            )
        return paged_decode(
            q, k_cache, v_cache, self.block_table.flatten(), self.max_context_len, self.mask
        )


def _context_slots(block_ids: tuple[int, ...], context_len: int, block_size: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(context_len)]


class TorchAttention:
    def prepare(
        self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        device = meta.positions.device
        bs = meta.block_size
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
            slots = _context_slots(s.block_ids, s.context_len, bs)
            mask = None
            if s.first_position > 0:
                # query i sits at position first_position + i and sees keys up to it
                q_pos = torch.arange(s.first_position, s.context_len, device=device)
                mask = torch.arange(s.context_len, device=device)[None, :] <= q_pos[:, None]
            prefills.append(
                _Prefill(s.query_start, s.num_tokens, torch.tensor(slots, device=device), mask)
            )
        meta.extra["torch_prefills"] = prefills
        if decode_rows:
            # Whole blocks are gathered (fewer index entries than per-token slots); positions
            # past a sequence's context are masked, or cut off when every context is as long.
            max_len = max(decode_lens)
            max_blocks = max(len(t) for t in decode_tables)
            padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
            lens = torch.tensor(decode_lens, device=device)
            mask = None
            if min(decode_lens) != max_len:
                mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[
                    :, None, None, :
                ]
            scratch = None
            if device.type == "cpu":
                floats = decode_kernel.scratch_floats(num_q_heads, num_kv_heads, head_dim, max_len)
                scratch = torch.empty(floats, dtype=torch.float32)
            meta.extra["torch_decodes"] = _Decodes(
                torch.tensor(decode_rows, device=device),
                not prefills and decode_rows == list(range(len(decode_rows))),
                torch.tensor(padded, device=device),
                lens,
                max_len,
                mask,
                scratch,
            )
        else:
            meta.extra["torch_decodes"] = None

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
            # 4-D [1, heads, tokens, D]: with 3-D inputs CPU SDPA falls back to the math
            # kernel, which materializes every score (8x slower at 1024 tokens)
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
