"""Llama family (Llama 2/3, Mistral, Yi, SmolLM2): RMSNorm, SwiGLU MLP, grouped KV heads, rotary.

Per layer, for one TP rank (Hq, Hkv: local query / KV heads; D: head_dim; F: local MLP width):
    x = x + all_reduce(o_proj(attention(rope(q), rope(k), v)))   q,k,v from one fused matmul
    x = x + all_reduce(down(silu(gate(n)) * up(n)))                n = post_attention_norm(x)
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
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    fused,
)
from stage_worker.models.base import StageLayer, StageModel
from stage_worker.models.llama_cpu_loop import CpuLayerLoop


class LlamaLayer(StageLayer):
    def __init__(
        self, spec: ModelSpec, shard: ShardSpec, tp: TPGroup, device: str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.spec, self.shard, self.tp = spec, shard, tp
        self.q_heads = shard.q_heads(spec)
        self.kv_heads = shard.kv_heads(spec)
        d, h = spec.head_dim, spec.hidden_size
        self.ffn_local = spec.ffn_size // shard.tp
        self.input_norm = RMSNorm(h, spec.norm_eps, device, dtype)
        self.qkv = ColumnParallelLinear(
            h, (len(self.q_heads) + 2 * len(self.kv_heads)) * d, device, dtype
        )
        self.o_proj = RowParallelLinear(len(self.q_heads) * d, h, device, dtype)
        self.post_norm = RMSNorm(h, spec.norm_eps, device, dtype)
        self.gate_up = ColumnParallelLinear(h, 2 * self.ffn_local, device, dtype)
        self.down = RowParallelLinear(self.ffn_local, h, device, dtype)

    def load(self, reader: CheckpointReader, layer_index: int) -> None:
        spec, d, h = self.spec, self.spec.head_dim, self.spec.hidden_size
        p = f"model.layers.{layer_index}."
        q_rows = (self.q_heads.start * d, self.q_heads.stop * d)
        kv_rows = (self.kv_heads.start * d, self.kv_heads.stop * d)
        self.qkv.load(
            torch.cat(
                [
                    reader.rows(p + "self_attn.q_proj.weight", (spec.num_heads * d, h), *q_rows),
                    reader.rows(
                        p + "self_attn.k_proj.weight", (spec.num_kv_heads * d, h), *kv_rows
                    ),
                    reader.rows(
                        p + "self_attn.v_proj.weight", (spec.num_kv_heads * d, h), *kv_rows
                    ),
                ]
            )
        )
        self.o_proj.load(
            reader.cols(p + "self_attn.o_proj.weight", (h, spec.num_heads * d), *q_rows)
        )
        f0, f1 = self.shard.tp_rank * self.ffn_local, (self.shard.tp_rank + 1) * self.ffn_local
        mlp_shape = (spec.ffn_size, h)
        self.gate_up.load(
            torch.cat(
                [
                    reader.rows(p + "mlp.gate_proj.weight", mlp_shape, f0, f1),
                    reader.rows(p + "mlp.up_proj.weight", mlp_shape, f0, f1),
                ]
            )
        )
        self.down.load(reader.cols(p + "mlp.down_proj.weight", (h, spec.ffn_size), f0, f1))
        self.input_norm.weight.data.copy_(reader.full(p + "input_layernorm.weight", (h,)))
        self.post_norm.weight.data.copy_(reader.full(p + "post_attention_layernorm.weight", (h,)))

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        # x: [T, hidden]
        d = self.spec.head_dim
        nq, nkv = len(self.q_heads), len(self.kv_heads)
        qkv = self.qkv(self.input_norm(x))  # [T, (nq + 2 nkv) * d]
        qk, v = qkv.split([(nq + nkv) * d, nkv * d], dim=-1)
        cos, sin = cos_sin
        # q and k heads sit side by side: one rotation for both halves the per-layer op count
        qk = RotaryEmbedding.apply(qk.view(-1, nq + nkv, d), cos, sin)  # [T, nq + nkv, d]
        q, k = qk.split([nq, nkv], dim=1)  # [T, nq, d], [T, nkv, d]
        attn = attention.forward(q, k, v.view(-1, nkv, d), kv[0], kv[1], meta)  # [T, nq, d]
        x, normed = self.post_norm.add_forward(
            x, self.tp.all_reduce(self.o_proj(attn.reshape(-1, nq * d)))
        )
        gate_up = self.gate_up(normed)  # [T, 2F]
        return x + self.tp.all_reduce(self.down(silu_mul(gate_up)))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2F] -> silu(gate) * up [T, F], one fused kernel on CUDA."""
    kernels = fused.kernels_for(gate_up)
    if kernels is not None:
        out: torch.Tensor = kernels.silu_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)  # [T, F] each
    return nn.functional.silu(gate) * up


class LlamaStage(StageModel):
    embed_name = "model.embed_tokens.weight"
    final_norm_name = "model.norm.weight"
    layer_loop: CpuLayerLoop | None = None
    """The layers as one loop over the C kernels, where a CPU float32 or bf16 step allows it
    (llama_cpu_loop.py); set by pack()."""

    def make_layer(self) -> StageLayer:
        return LlamaLayer(self.spec, self.shard, self.tp, self.device, self.dtype)

    def llama_layers(self) -> list[LlamaLayer]:
        """The layers, typed as what make_layer() builds."""
        return [layer for layer in self.layers if isinstance(layer, LlamaLayer)]

    def pack(self) -> None:
        super().pack()
        self.layer_loop = CpuLayerLoop.build(self)

    def run_layers(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        loop = self.layer_loop
        step = loop.step_for(hidden, meta, kv_cache) if loop is not None else None
        if loop is None or step is None:
            return super().run_layers(hidden, cos_sin, meta, kv_cache, attention)
        return loop.forward(hidden, cos_sin, kv_cache, meta, step, attention)

    def make_final_norm(self) -> nn.Module:
        return RMSNorm(self.spec.hidden_size, self.spec.norm_eps, self.device, self.dtype)

    def load_final_norm(self, reader: CheckpointReader) -> None:
        assert isinstance(self.final_norm, RMSNorm)
        self.final_norm.weight.data.copy_(
            reader.full(self.final_norm_name, (self.spec.hidden_size,))
        )
