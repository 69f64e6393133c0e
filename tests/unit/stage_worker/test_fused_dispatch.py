"""The fused Triton kernels are CUDA-only: on the CPU every layer takes torch's own ops, and
nothing imports Triton (the CPU build of torch ships without it)."""

from __future__ import annotations

import sys

import torch

from stage_worker.layers import RMSNorm, RotaryEmbedding, fused
from stage_worker.models.llama import silu_mul


def test_cpu_tensors_take_torch_ops_and_never_import_triton() -> None:
    x = torch.randn(3, 64)
    assert fused.kernels_for(x) is None
    norm = RMSNorm(64, 1e-6, "cpu", torch.float32)
    expected = torch.nn.functional.rms_norm(x, (64,), eps=1e-6)
    torch.testing.assert_close(norm(x), expected)
    gate_up = torch.randn(3, 16)
    torch.testing.assert_close(
        silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :8]) * gate_up[:, 8:]
    )
    cos, sin = RotaryEmbedding(8, 10000.0, None, "cpu").cos_sin(torch.arange(3), torch.float32)
    assert RotaryEmbedding.apply(torch.randn(3, 2, 8), cos, sin).shape == (3, 2, 8)
    assert "stage_worker.layers.triton_ops" not in sys.modules

