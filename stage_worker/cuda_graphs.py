"""Decode steps replayed from CUDA graphs.

An eager decode step launches about a dozen kernels per layer, each a few microseconds of work at
small batches, so on a fast GPU the CPU's launches, not the GPU, set the pace. Serving engines
capture the decode step once per batch-size bucket and replay it; so does this module.

A step of decodes only (one token per sequence) is padded up to a batch bucket and replayed from
that bucket's graph, captured on first use. Padding rows write their K and V into the cache's
scratch block and attend to that block alone, so they never touch a sequence's blocks. Before
each replay the attention's `load` puts the step's block tables where the graph reads them:
- torch attention (StaticDecodeAttention) reads a static table [B, M] and context lengths [B],
  so its graphs are per (batch, table size) bucket. With Triton (CUDA's torch builds) one kernel
  writes the step's K and V and attends (attention/triton_decode.py); else torch's paged_decode
  masks positions past a context;
- flashinfer (attention.flashinfer_backend.FlashInferGraphDecode) plans ragged tables on the
  host into fixed buffers: one graph per batch bucket serves every context up to the largest.
Other steps (prompt chunks, larger batches, longer contexts) run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from stage_worker.attention import AttentionBackend, AttentionMetadata, SeqSlice
from stage_worker.attention.base import write_kv
from stage_worker.attention.torch_backend import paged_decode
from stage_worker.kv_cache import KVCache
from stage_worker.layers import fused
from stage_worker.models import StageModel

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_TABLE_BLOCKS = 16
"""The smallest block-table bucket."""
MAX_TABLE_BLOCKS = 1024
"""Contexts beyond this many blocks (16k tokens of 16-token blocks) decode eagerly."""


def _table_buckets() -> tuple[int, ...]:
    """16, 24, 32, 48, 64, ..., 1024: the powers of two from MIN_TABLE_BLOCKS and the midpoints
    between them, so a graph attends over at most 1.5x the blocks its longest context needs.
    With doubling alone, 513-token contexts (33 blocks) padded to 64 and made graphs slower than
    eager from batch 32 (H200, BENCHMARKS.md)."""
    buckets, size = [], MIN_TABLE_BLOCKS
    while size <= MAX_TABLE_BLOCKS:
        buckets += [size, size * 3 // 2] if size < MAX_TABLE_BLOCKS else [size]
        size *= 2
    return tuple(buckets)


TABLE_BUCKETS = _table_buckets()


def bucket_of(seqs: list[SeqSlice], block_size: int) -> tuple[int, int] | None:
    """(padded batch, blocks per table row) of a decode-only step, or None to run it eagerly."""
    if not seqs or any(s.num_tokens != 1 for s in seqs):
        return None
    batch = next((b for b in BATCH_BUCKETS if b >= len(seqs)), None)
    longest = max(-(-s.context_len // block_size) for s in seqs)
    table = next((t for t in TABLE_BUCKETS if t >= longest), None)
    if batch is None or table is None:
        return None
    return batch, table


class GraphAttention(AttentionBackend, Protocol):
    """An attention backend whose per-step state lives in buffers a graph captured."""

    def load(self, seqs: list[SeqSlice], scratch_block: int) -> None:
        """On the host, before a replay: the step's tables where the graph reads them; rows
        past `seqs` are padding that attends one slot of the scratch block."""
        ...


class StaticDecodeAttention:
    """Torch decode attention over a block table and context lengths that stay put between
    replays (filled by `load`)."""

    def __init__(self, batch: int, table: int, block_size: int, device: str) -> None:
        # [B * M + B] int64: the block table, then the context lengths (one copy from the host)
        self._table_and_lens = torch.zeros(batch * table + batch, dtype=torch.int64, device=device)
        self.block_table = self._table_and_lens[: batch * table].view(batch, table)  # [B, M]
        self.context_lens = self._table_and_lens[batch * table :]  # [B]
        self.block_size = block_size
        self.max_context_len = table * block_size
        self._positions = torch.arange(self.max_context_len, device=device)
        self._mask: torch.Tensor | None = None
        self._kernel = fused.decode_attention_kernel(device)
        """attention.triton_decode, or None for torch's paged_decode."""
        self._scratch: Any = None
        """The kernel's split scratch (triton_decode.DecodeScratch), made at prepare()."""

    def load(self, seqs: list[SeqSlice], scratch_block: int) -> None:
        (batch, table), bs = self.block_table.shape, self.block_size
        host: list[int] = []
        for s in seqs:
            used = s.block_ids[: -(-s.context_len // bs)]
            host.extend(used)
            host.extend([scratch_block] * (table - len(used)))
        host.extend([scratch_block] * (table * (batch - len(seqs))))
        host.extend(s.context_len for s in seqs)
        host.extend([1] * (batch - len(seqs)))
        self._table_and_lens.copy_(torch.tensor(host, dtype=torch.int64), non_blocking=False)

    def prepare(
        self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        """Once per step, before the first layer (so inside the captured graph): the mask of
        each row's context, shared by every layer (torch's path); the kernel's scratch."""
        if self._kernel is not None and self._kernel.takes_heads(
            num_q_heads, num_kv_heads, head_dim, meta.dtype or torch.float32
        ):
            if self._scratch is None:
                self._scratch = self._kernel.DecodeScratch(
                    self.block_table.shape[0], num_kv_heads, num_q_heads // num_kv_heads,
                    head_dim, self._kernel.num_splits(self.max_context_len),
                    self._positions.device,
                )  # fmt: skip
            return
        self._scratch = None
        # [B, 1, 1, M * block_size] True = attend
        self._mask = (self._positions[None, :] < self.context_lens[:, None])[:, None, None, :]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # q: [B, Hq, D]; k, v: [B, Hkv, D] -> [B, Hq, D]
        if self._scratch is not None and self._kernel is not None:
            out: torch.Tensor = self._kernel.paged_decode_write(
                q, k, v, k_cache, v_cache, self.block_table, self.context_lens,
                meta.slot_mapping, self._scratch,
            )  # fmt: skip
            return out
        assert self._mask is not None, "prepare() runs before the first layer"
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_decode(
            q, k_cache, v_cache, self.block_table.flatten(), self.max_context_len, self._mask
        )


@dataclass
class _DecodeGraph:
    """One bucket's captured step and the static tensors it reads and writes."""

    inputs: torch.Tensor
    """[B] int64 token ids (first stage) or [B, hidden] activations."""
    meta: AttentionMetadata
    """positions [B] and slot_mapping [B] are static buffers."""
    attention: GraphAttention
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None
    """[B, hidden] written by each replay."""


class DecodeGraphs:
    """Captured decode steps of one stage model over one KV cache, with torch or flashinfer
    attention."""

    def __init__(self, model: StageModel, kv_cache: KVCache, attention: str = "torch") -> None:
        if not str(model.device).startswith("cuda"):
            raise ValueError(f"CUDA graphs need a CUDA device, not {model.device}")
        if attention not in ("torch", "flashinfer"):
            raise ValueError(f"attention={attention!r}: must be torch or flashinfer")
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()  # one memory pool shared by every graph
        self._workspace: torch.Tensor | None = None
        """flashinfer's float workspace, shared by every graph's wrapper."""

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def run(self, meta: AttentionMetadata, inputs: torch.Tensor) -> torch.Tensor | None:
        """The step's hidden states [n, hidden], as the eager model would give them; None for a
        step no graph takes (it runs eagerly)."""
        key = bucket_of(meta.seqs, self.kv_cache.block_size)
        if key is None:
            return None
        if self.attention == "flashinfer":  # ragged tables: one graph per batch
            key = (key[0], MAX_TABLE_BLOCKS)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(*key)
        self._load(entry, meta, inputs)
        assert entry.graph is not None and entry.out is not None
        entry.graph.replay()
        # a copy: the next replay overwrites `out` while this step's result may still be in use
        return entry.out[: len(meta.seqs)].clone()

    def _load(self, entry: _DecodeGraph, meta: AttentionMetadata, inputs: torch.Tensor) -> None:
        n, cache = len(meta.seqs), self.kv_cache
        batch = entry.inputs.shape[0]
        entry.attention.load(meta.seqs, cache.scratch_block)
        entry.meta.positions[:n].copy_(meta.positions)
        entry.meta.slot_mapping[:n].copy_(meta.slot_mapping)
        entry.inputs[:n].copy_(inputs)
        if n < batch:
            entry.meta.positions[n:].zero_()
            entry.meta.slot_mapping[n:].fill_(cache.scratch_block * cache.block_size)
            entry.inputs[n:].zero_()

    def _graph_attention(self, batch: int, table: int) -> GraphAttention:
        model, cache = self.model, self.kv_cache
        if self.attention == "torch":
            return StaticDecodeAttention(batch, table, cache.block_size, model.device)
        # imported only here: flashinfer exists on CUDA machines only
        from stage_worker.attention.flashinfer_backend import WORKSPACE_BYTES, FlashInferGraphDecode

        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=model.device)
        heads = (model.num_q_heads_local, model.num_kv_heads_local, model.spec.head_dim)
        return FlashInferGraphDecode(
            self._workspace, batch, table, heads, cache.block_size, model.dtype
        )

    def _capture(self, batch: int, table: int) -> _DecodeGraph:
        model, cache, device = self.model, self.kv_cache, self.model.device
        scratch_slot = cache.scratch_block * cache.block_size
        if model.embed is not None:
            inputs = torch.zeros(batch, dtype=torch.int64, device=device)
        else:
            inputs = torch.zeros(batch, model.spec.hidden_size, dtype=model.dtype, device=device)
        meta = AttentionMetadata(
            seqs=[],
            positions=torch.zeros(batch, dtype=torch.int64, device=device),
            slot_mapping=torch.full((batch,), scratch_slot, dtype=torch.int64, device=device),
            block_size=cache.block_size,
        )
        attention = self._graph_attention(batch, table)
        attention.load([], cache.scratch_block)  # every row padding until the first replay
        entry = _DecodeGraph(inputs, meta, attention)

        def step() -> torch.Tensor:
            return model(entry.inputs, entry.meta, cache, entry.attention)

        # Warm-up on a side stream (as torch asks before capture): lazy initialisations and the
        # allocator's pool settle; with padding everywhere it writes the scratch block only.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        entry.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(entry.graph, pool=self._pool):
            entry.out = step()
        logger.info(
            "captured the decode step for batch %d, %d-block tables, %s attention",
            batch, table, self.attention,
        )  # fmt: skip
        return entry
