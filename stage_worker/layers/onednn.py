"""Weights prepacked in oneDNN's blocked layout for CPU matmuls, as vLLM's CPU backend does.

bf16: `F.linear` on CPU bf16 already runs oneDNN, and gives bit-identical results, but apparently
lays the plain weight out for the kernel on every call; packing once at load time skips that,
and one-token matmuls run 1.2x to 1.6x faster on the AVX512-BF16 EPYC (see BENCHMARKS.md).

float32: `F.linear` runs MKL, which does not spread a matmul of a few rows over threads: on the
AMD EPYC without AVX-512, two threads read 212 MB of float32 weights for 1 or 4 tokens in 17 and
30 ms against one thread's 20 and 32, where oneDNN's packed matmul takes 12 and 22 (BENCHMARKS
"float32 linear layers on two threads"). On one thread MKL is 5-13% faster, so float32 weights
are packed only where the worker runs more than one thread. The sums run in another order:
logits move by about 1e-4 against MKL's. Where the CPU has AVX2 and FMA, the package's own
float32 kernel (cpu_matmul.py) is faster than both and takes float32 weights first.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed matmul beats F.linear for this weight here (module docstring)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32 and torch.get_num_threads() > 1


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out, in] strided -> [out, in] oneDNN-blocked (an opaque mkldnn tensor)."""
    # The 1 is the expected token count: a layout hint only, any count works afterwards.
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [n, in], weight: [out, in] (strided or packed) -> [n, out]
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
    return nn.functional.linear(x, weight)
