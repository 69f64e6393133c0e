"""Tensor-parallel building blocks. Each layer holds only its rank's share of the weights;
collectives are called by the model code, where a reader can see them."""

from stage_worker.layers import fused, onednn
from stage_worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from stage_worker.layers.linear import ColumnParallelLinear, RowParallelLinear, ShardedLinear
from stage_worker.layers.norm import LayerNorm, RMSNorm
from stage_worker.layers.rotary import RotaryEmbedding

__all__ = [
    "ColumnParallelLinear",
    "LayerNorm",
    "ParallelLMHead",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "ShardedLinear",
    "VocabParallelEmbedding",
    "fused",
    "onednn",
]
