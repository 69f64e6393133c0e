"""bf16 weights prepacked in oneDNN's blocked layout for CPU matmuls.

`F.linear` on CPU bf16 already runs oneDNN, but reorders the weight into oneDNN's blocked layout
on every call; for a decode step (one token per sequence) that reorder costs as much as the
matmul itself. Packing once at load time gives the same kernel the same inputs, so results are
bit-identical, and one-token matmuls run ~1.5x faster on AVX512-BF16 CPUs (see BENCHMARKS.md).
float32 and GPU weights are left as they are: float32 runs MKL, not oneDNN, and would change
rounding against the transformers oracle.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out, in] strided -> [out, in] oneDNN-blocked (an opaque mkldnn tensor)."""
    # The 1 is the expected token count: a layout hint only, any count works afterwards.
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [n, in], weight: [out, in] (strided or packed) -> [n, out]
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
    return nn.functional.linear(x, weight)
