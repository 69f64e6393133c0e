"""FlashInfer attention (CUDA only): one BatchPrefillWithPagedKVCacheWrapper plan per step,
reused by every layer. Prefill chunks and decodes are both "prefill" rows of the ragged batch
(a decode is a chunk of length 1); flashinfer's causal mask aligns the chunk to the end of its
context, which is exactly "earlier tokens in the cache plus causal within the chunk"."""

from __future__ import annotations

import importlib

import torch

from stage_worker.attention.base import AttentionMetadata, write_kv

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttention:
    def __init__(self, device: str) -> None:
        if not torch.cuda.is_available():
            raise ValueError("attention=flashinfer needs CUDA; use attention=torch on this machine")
        # Imported only here: the package exists on CUDA machines only.
        flashinfer = importlib.import_module("flashinfer")

        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def prepare(
        self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        qo_indptr = [0]
        kv_indptr = [0]
        kv_indices: list[int] = []
        last_page_len: list[int] = []
        bs = meta.block_size
        for s in meta.seqs:
            num_pages = -(-s.context_len // bs)
            qo_indptr.append(qo_indptr[-1] + s.num_tokens)
            kv_indices.extend(s.block_ids[:num_pages])
            kv_indptr.append(kv_indptr[-1] + num_pages)
            last_page_len.append(s.context_len - (num_pages - 1) * bs)

        def i32(values: list[int]) -> torch.Tensor:
            # on the host: plan() reads the indptrs there to split the work, and copies what the
            # kernel needs to the GPU itself (device tensors would cost a sync each)
            return torch.tensor(values, dtype=torch.int32)

        self._wrapper.plan(
            i32(qo_indptr),
            i32(kv_indptr),
            i32(kv_indices),
            i32(last_page_len),
            num_q_heads,
            num_kv_heads,
            head_dim,
            bs,
            causal=True,
            q_data_type=meta.extra.get("dtype", torch.bfloat16),
            kv_data_type=meta.extra.get("dtype", torch.bfloat16),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D] (NHD)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out: torch.Tensor = self._wrapper.run(q.contiguous(), (k_cache, v_cache))
        return out  # [T, Hq, D]
