"""bf16 weights prepacked in oneDNN's blocked layout for CPU matmuls.

`F.linear` on CPU bf16 already runs oneDNN, and gives bit-identical results, but apparently
lays the plain weight out for the kernel on every call; packing once at load time skips that,
and one-token matmuls run 1.2x to 1.6x faster on this AVX512-BF16 EPYC (see BENCHMARKS.md).
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
