"""Falcon: the multi-query layout of Falcon-7B and the new decoder architecture of
Falcon-40B/180B (grouped KV heads, two layer norms, attention and MLP in parallel), rotary only.

Per layer, for one TP rank (parallel attention, the layout of all three published models):
    a, m = ln_attn(x), ln_mlp(x)            (one shared input_layernorm on Falcon-7B)
    x = x + all_reduce(dense(attention(a)) + dense_4h_to_h(gelu(dense_h_to_4h(m))))
The two row-parallel outputs are summed before one all-reduce: half the collectives.

The fused query_key_value weight [rows, hidden] orders its rows differently per layout:
    new decoder: K groups of (H/K query heads, then 1 key head, then 1 value head), D rows each
    multi-query: all H query heads, then 1 key head, then 1 value head
    neither:     per head (query, key, value)
"""

from __future__ import annotations

import torch
from torch import nn

from stage_worker.attention import AttentionBackend, AttentionMetadata
from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ModelSpec, ShardSpec
from stage_worker.layers import ColumnParallelLinear, LayerNorm, RotaryEmbedding, RowParallelLinear
from stage_worker.models.base import StageLayer, StageModel


def fused_qkv_rows(
    reader: CheckpointReader, name: str, spec: ModelSpec, shard: ShardSpec
) -> torch.Tensor:
    """This rank's rows of query_key_value, reordered as [q heads; k heads; v heads]."""
    d, h, nh, nkv = spec.head_dim, spec.hidden_size, spec.num_heads, spec.num_kv_heads
    q_heads, kv_heads = shard.q_heads(spec), shard.kv_heads(spec)
    if spec.new_decoder_architecture:
        group = spec.num_q_per_kv + 2  # rows per KV group, in head_dim units
        shape = ((nh + 2 * nkv) * d, h)
        rows = reader.rows(name, shape, kv_heads.start * group * d, kv_heads.stop * group * d)
        rows = rows.view(len(kv_heads), group, d, h)
        # q heads of the groups read, then keep this rank's (a sub-range when tp > kv heads)
        first = q_heads.start - kv_heads.start * spec.num_q_per_kv
        q = rows[:, :-2].reshape(-1, d, h)[first : first + len(q_heads)]
        k, v = rows[:, -2], rows[:, -1]  # [kv_local, d, h]
        return torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
    if spec.multi_query:
        shape = ((nh + 2) * d, h)
        q = reader.rows(name, shape, q_heads.start * d, q_heads.stop * d)
        kv = reader.rows(name, shape, nh * d, (nh + 2) * d)  # the one key and value head
        return torch.cat([q, kv])
    shape = (3 * nh * d, h)
    rows = reader.rows(name, shape, q_heads.start * 3 * d, q_heads.stop * 3 * d)
    rows = rows.view(len(q_heads), 3, d, h)
    return torch.cat([rows[:, i].reshape(-1, h) for i in range(3)])


class FalconLayer(StageLayer):
    def __init__(
        self, spec: ModelSpec, shard: ShardSpec, tp: TPGroup, device: str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.spec, self.shard, self.tp = spec, shard, tp
        self.nq, self.nkv = len(shard.q_heads(spec)), len(shard.kv_heads(spec))
        d, h = spec.head_dim, spec.hidden_size
        self.ffn_local = spec.ffn_size // shard.tp
        self.parallel = spec.new_decoder_architecture or spec.parallel_attn
        self.two_norms = spec.new_decoder_architecture and spec.num_ln_in_parallel_attn == 2
        eps = spec.norm_eps
        if self.two_norms:
            self.norm_names = ["ln_attn", "ln_mlp"]
        elif self.parallel:
            self.norm_names = ["input_layernorm"]
        else:
            self.norm_names = ["input_layernorm", "post_attention_layernorm"]
        self.norms = nn.ModuleList(LayerNorm(h, eps, device, dtype) for _ in self.norm_names)
        self.qkv = ColumnParallelLinear(h, (self.nq + 2 * self.nkv) * d, device, dtype)
        self.dense = RowParallelLinear(self.nq * d, h, device, dtype)
        self.h_to_4h = ColumnParallelLinear(h, self.ffn_local, device, dtype)
        self.four_h_to_h = RowParallelLinear(self.ffn_local, h, device, dtype)

    def load(self, reader: CheckpointReader, layer_index: int) -> None:
        spec, d, h = self.spec, self.spec.head_dim, self.spec.hidden_size
        p = f"transformer.h.{layer_index}."
        self.qkv.load(
            fused_qkv_rows(reader, p + "self_attention.query_key_value.weight", spec, self.shard)
        )
        q_heads = self.shard.q_heads(spec)
        self.dense.load(
            reader.cols(
                p + "self_attention.dense.weight", (h, h), q_heads.start * d, q_heads.stop * d
            )
        )
        f0, f1 = self.shard.tp_rank * self.ffn_local, (self.shard.tp_rank + 1) * self.ffn_local
        self.h_to_4h.load(reader.rows(p + "mlp.dense_h_to_4h.weight", (spec.ffn_size, h), f0, f1))
        self.four_h_to_h.load(
            reader.cols(p + "mlp.dense_4h_to_h.weight", (h, spec.ffn_size), f0, f1)
        )
        for norm, name in zip(self.norms, self.norm_names, strict=True):
            assert isinstance(norm, LayerNorm)
            norm.weight.data.copy_(reader.full(p + name + ".weight", (h,)))
            norm.bias.data.copy_(reader.full(p + name + ".bias", (h,)))

    def _attention(
        self,
        a: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        # a: [T, hidden] -> partial sums [T, hidden] (before the all-reduce)
        d, nq, nkv = self.spec.head_dim, self.nq, self.nkv
        q, k, v = self.qkv(a).split([nq * d, nkv * d, nkv * d], dim=-1)
        cos, sin = cos_sin
        q = RotaryEmbedding.apply(q.view(-1, nq, d), cos, sin)  # [T, nq, d]
        k = RotaryEmbedding.apply(k.view(-1, nkv, d), cos, sin)  # [T, nkv, d]
        out = attention.forward(q, k, v.view(-1, nkv, d), kv[0], kv[1], meta)  # [T, nq, d]
        return self.dense(out.reshape(-1, nq * d))

    def _mlp(self, m: torch.Tensor) -> torch.Tensor:
        # m: [T, hidden] -> partial sums [T, hidden]
        return self.four_h_to_h(nn.functional.gelu(self.h_to_4h(m)))

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        # x: [T, hidden]
        if not self.parallel:
            x = x + self.tp.all_reduce(
                self._attention(self.norms[0](x), cos_sin, kv, meta, attention)
            )
            return x + self.tp.all_reduce(self._mlp(self.norms[1](x)))
        a = self.norms[0](x)
        m = self.norms[1](x) if self.two_norms else a
        attn = self._attention(a, cos_sin, kv, meta, attention)
        return x + self.tp.all_reduce(attn + self._mlp(m))


class FalconStage(StageModel):
    embed_name = "transformer.word_embeddings.weight"
    final_norm_name = "transformer.ln_f"

    def make_layer(self) -> StageLayer:
        return FalconLayer(self.spec, self.shard, self.tp, self.device, self.dtype)

    def make_final_norm(self) -> nn.Module:
        return LayerNorm(self.spec.hidden_size, self.spec.norm_eps, self.device, self.dtype)

    def load_final_norm(self, reader: CheckpointReader) -> None:
        assert isinstance(self.final_norm, LayerNorm)
        h = self.spec.hidden_size
        self.final_norm.weight.data.copy_(reader.full(self.final_norm_name + ".weight", (h,)))
        self.final_norm.bias.data.copy_(reader.full(self.final_norm_name + ".bias", (h,)))
