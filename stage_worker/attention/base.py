"""The attention interface: metadata built once per step, shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's chunk inside the step's flat token batch."""

    query_start: int
    """Index of the chunk's first token in the step's [num_tokens] batch."""
    num_tokens: int
    context_len: int
    """Tokens attended: the earlier ones in the cache plus this chunk."""
    block_ids: tuple[int, ...]
    """The sequence's block table, covering at least context_len tokens."""

    @property
    def first_position(self) -> int:
        return self.context_len - self.num_tokens


@dataclass
class AttentionMetadata:
    seqs: list[SeqSlice]
    positions: torch.Tensor
    """[num_tokens] int64: position of each token in its sequence."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64: flat cache slot (block_id * block_size + offset) of each new token."""
    block_size: int
    dtype: torch.dtype | None = None
    """The model's dtype, set by StageModel.forward before backend.prepare; None where a caller
    builds metadata without a model (each backend then assumes its usual dtype)."""
    # Backend-specific precomputed state (e.g. flashinfer's plan), filled by backend.prepare.
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def build_metadata(seqs: list[SeqSlice], block_size: int, device: str) -> AttentionMetadata:
    positions: list[int] = []
    slots: list[int] = []
    for s in seqs:
        for pos in range(s.first_position, s.context_len):
            positions.append(pos)
            slots.append(s.block_ids[pos // block_size] * block_size + pos % block_size)
    return AttentionMetadata(
        seqs=seqs,
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=block_size,
    )


class AttentionBackend(Protocol):
    def prepare(
        self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        """Per-step set-up shared by all layers (called once before the first layer)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Writes k, v into the cache at meta.slot_mapping, then attends.
        q: [num_tokens, q_heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim];
        caches: [num_blocks, block_size, kv_heads, head_dim] -> [num_tokens, q_heads, head_dim]."""
        ...


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    # flat views: [num_blocks * block_size, kv_heads, head_dim]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
