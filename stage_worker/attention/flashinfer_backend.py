"""FlashInfer attention (CUDA only): one BatchPrefillWithPagedKVCacheWrapper plan per step,
reused by every layer. Prefill chunks and decodes are both "prefill" rows of the ragged batch
(a decode is a chunk of length 1); flashinfer's causal mask aligns the chunk to the end of its
context, which is exactly "earlier tokens in the cache plus causal within the chunk"."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from stage_worker.attention.base import AttentionMetadata, SeqSlice, write_kv

WORKSPACE_BYTES = 128 * 1024 * 1024


class _FlashInferRun:
    """What both flashinfer backends do per layer: write the step's K and V, then attend with the
    wrapper their plan set up."""

    _wrapper: Any  # flashinfer.BatchPrefillWithPagedKVCacheWrapper (imported only on CUDA)

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


class FlashInferAttention(_FlashInferRun):
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
            q_data_type=meta.dtype or torch.bfloat16,
            kv_data_type=meta.dtype or torch.bfloat16,
        )


class FlashInferGraphDecode(_FlashInferRun):
    """Decode attention for a captured CUDA graph: flashinfer's kernel over index buffers of a
    fixed batch, so one graph per batch size serves every mix of context lengths (the torch
    path needs a graph per table size too: cuda_graphs.StaticDecodeAttention). `load` plans on
    the host before every replay and fills the buffers the captured kernel reads."""

    def __init__(
        self,
        workspace: torch.Tensor,
        batch: int,
        max_blocks: int,
        heads: tuple[int, int, int],
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        flashinfer = importlib.import_module("flashinfer")
        device = workspace.device
        self.batch = batch
        self.block_size = block_size
        self.dtype = dtype
        self.q_heads, self.kv_heads, self.head_dim = heads

        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace,  # shared by every graph's wrapper: graphs replay one at a time
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=buffer(batch + 1),
            paged_kv_indptr_buf=buffer(batch + 1),
            paged_kv_indices_buf=buffer(batch * max_blocks),
            paged_kv_last_page_len_buf=buffer(batch),
        )

    def load(self, seqs: list[SeqSlice], scratch_block: int) -> None:
        """Plans the step of `seqs` (decodes, at most `batch`); the rows up to `batch` are
        padding that attends one slot of the scratch block."""
        bs = self.block_size
        kv_indptr, indices, last_page_len = [0], list[int](), list[int]()
        for s in seqs:
            pages = -(-s.context_len // bs)
            indices.extend(s.block_ids[:pages])
            kv_indptr.append(kv_indptr[-1] + pages)
            last_page_len.append(s.context_len - (pages - 1) * bs)
        for _ in range(self.batch - len(seqs)):
            indices.append(scratch_block)
            kv_indptr.append(kv_indptr[-1] + 1)
            last_page_len.append(1)
        self._wrapper.plan(
            torch.arange(self.batch + 1, dtype=torch.int32),
            torch.tensor(kv_indptr, dtype=torch.int32),
            torch.tensor(indices, dtype=torch.int32),
            torch.tensor(last_page_len, dtype=torch.int32),
            self.q_heads,
            self.kv_heads,
            self.head_dim,
            bs,
            causal=True,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def prepare(
        self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        """Nothing inside the graph: `load` planned the step before the replay."""
