"""What every model family shares: a stage holds its layer range, plus the embedding on the first
stage and the final norm and LM head on the last. Families supply the layer and the tensor names.
"""

from __future__ import annotations

import torch
from torch import nn

from stage_worker.attention import AttentionBackend, AttentionMetadata
from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ModelSpec, ShardSpec
from stage_worker.kv_cache import KVCache
from stage_worker.layers import (
    ParallelLMHead,
    RotaryEmbedding,
    ShardedLinear,
    VocabParallelEmbedding,
)


class StageLayer(nn.Module):
    """One decoder layer of a family; forward(hidden, cos_sin, kv, meta, attention) -> hidden."""

    def load(self, reader: CheckpointReader, layer_index: int) -> None:
        """Copies this rank's slices of layer `layer_index` from the checkpoint."""
        raise NotImplementedError


class StageModel(nn.Module):
    """One pipeline stage for one TP rank. Subclasses set the names and build the layers."""

    embed_name: str
    final_norm_name: str
    lm_head_name = "lm_head.weight"

    def __init__(
        self, spec: ModelSpec, shard: ShardSpec, tp: TPGroup, device: str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        shard.check_heads(spec)
        self.spec = spec
        self.shard = shard
        self.tp = tp
        self.device = device
        self.dtype = dtype
        self.layer_ids = shard.layer_range(spec)
        self.num_q_heads_local = len(shard.q_heads(spec))
        self.num_kv_heads_local = len(shard.kv_heads(spec))
        self.embed = (
            VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp, device, dtype)
            if shard.is_first
            else None
        )
        self.layers = nn.ModuleList(self.make_layer() for _ in self.layer_ids)
        self.final_norm = self.make_final_norm() if shard.is_last else None
        self.lm_head = (
            ParallelLMHead(spec.vocab_size, spec.hidden_size, tp, device, dtype)
            if shard.is_last
            else None
        )
        rope_device = "cpu" if device == "meta" else device
        self.rotary = RotaryEmbedding(
            spec.head_dim, spec.rope_theta, spec.rope_scaling, rope_device
        )

    # ---- family hooks ----------------------------------------------------------------------
    def make_layer(self) -> StageLayer:
        raise NotImplementedError

    def make_final_norm(self) -> nn.Module:
        raise NotImplementedError

    def load_final_norm(self, reader: CheckpointReader) -> None:
        raise NotImplementedError

    # ---- loading ---------------------------------------------------------------------------
    def load(self, reader: CheckpointReader) -> None:
        """Copies this rank's slices of this stage's tensors from the checkpoint."""
        spec = self.spec
        shape = (spec.vocab_size, spec.hidden_size)
        if self.embed is not None:
            self.embed.weight.data.copy_(
                reader.rows(self.embed_name, shape, self.embed.start, self.embed.stop)
            )
        for layer, index in zip(self.layers, self.layer_ids, strict=True):
            assert isinstance(layer, StageLayer)
            layer.load(reader, index)
        if self.lm_head is not None:
            self.load_final_norm(reader)
            name = self.lm_head_name
            if not reader.has(name) and spec.tie_word_embeddings:
                name = self.embed_name  # tied: the head is the embedding matrix
            if name == self.embed_name and self.embed is not None:
                self.lm_head.weight = self.embed.weight  # same rows on this rank: hold them once
            else:
                self.lm_head.weight.data.copy_(
                    reader.rows(name, shape, self.lm_head.start, self.lm_head.stop)
                )
        self.pack()

    def pack(self) -> None:
        """Weights into the matmul kernels' own layout, once all are loaded (onednn.py)."""
        for module in self.modules():
            if isinstance(module, ShardedLinear):
                module.pack()
        if self.lm_head is not None:
            shared = self.embed is not None and self.lm_head.weight is self.embed.weight
            self.lm_head.pack(self.embed if shared else None)

    # ---- compute ---------------------------------------------------------------------------
    def forward(
        self,
        inputs: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """inputs: token ids [num_tokens] (first stage) or hidden [num_tokens, hidden];
        -> hidden [num_tokens, hidden] (after the final norm on the last stage)."""
        hidden = self.embed(inputs) if self.embed is not None else inputs
        meta.dtype = self.dtype
        attention.prepare(meta, self.num_q_heads_local, self.num_kv_heads_local, self.spec.head_dim)
        cos_sin = self.rotary.cos_sin(meta.positions, self.dtype)
        hidden = self.run_layers(hidden, cos_sin, meta, kv_cache, attention)
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return hidden

    def run_layers(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """hidden: [num_tokens, hidden] through this stage's layers, each a module call (a
        family may take some steps another way)."""
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos_sin, kv_cache.layer(index), meta, attention)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden] (normed) -> [n, vocab] float32
        assert self.lm_head is not None, "only the last stage has the LM head"
        return self.lm_head(hidden)

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @property
    def kernel_copy_bytes(self) -> int:
        """Bytes of weights held a second time beside param_bytes, in a CPU kernel's own layout
        or kept as loaded: the bf16 kernel's panels (matmul_bf16.py), the small-batch kernel's
        plain rows (gemv.py), a tied head's oneDNN copy, an untied bf16 head's rows. Each
        tensor counts once, and none that a parameter holds."""
        held = {_address(p) for p in self.parameters()}
        copies: dict[int, int] = {}
        for module in self.modules():
            if not isinstance(module, (ShardedLinear, ParallelLMHead)):
                continue
            tensors = [module.bf16.panels if module.bf16 is not None else None, module.plain]
            if isinstance(module, ParallelLMHead):
                tensors += [module.packed, module.rows]
            for t in tensors:
                if t is not None and _address(t) not in held:
                    copies[_address(t)] = t.numel() * t.element_size()
        return sum(copies.values())

    def linear_shapes(self) -> list[tuple[int, int]]:
        """[out, in] of every linear layer's weight on this rank, in the stage's order (known
        before load, on the meta device too): what matmul_bf16_dispatch.py times."""
        return [
            (m.out_features, m.in_features) for m in self.modules() if isinstance(m, ShardedLinear)
        ]


def _address(t: torch.Tensor) -> int:
    """Where t's values lie (a oneDNN-packed tensor has no data pointer: its identity)."""
    return id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
