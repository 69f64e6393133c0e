"""The fused elementwise ops on the CPU (stage_worker/csrc/fused_ops.c), with the same
functions as triton_ops.py so that layers call either through fused.kernels_for.

Why: at decode sizes torch's CPU ops cost their dispatch, not their arithmetic; a Llama layer's
norms, rotary and SiLU-times-up are about a dozen of them. Each function here is one call into
the C module, which checks every tensor (dtype, shape, strides) before it reads one, and shares
a prompt chunk's rows out over torch's threads.
"""

from __future__ import annotations

import torch

from stage_worker import native


def _module():  # type: ignore[no-untyped-def]
    module = native.fused_kernels()
    assert module is not None, "called where fused.kernels_for returned None"
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] (rows may be strided), weight: [H] -> weight * rms_norm(x) [T, H]."""
    out = torch.empty(x.shape, dtype=x.dtype)
    _module().fused_rms_norm(
        native.capsule(x), native.capsule(weight), native.capsule(out), eps, torch.get_num_threads()
    )
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (token and head strides free); cos, sin: [T, 1, D] -> x rotated
    (rotate-half form), [T, heads, D] contiguous."""
    out = torch.empty(x.shape, dtype=x.dtype)
    _module().fused_rotary(
        native.capsule(x),
        native.capsule(cos.flatten(1)),  # [T, D]: the module checks it against x
        native.capsule(sin.flatten(1)),
        native.capsule(out),
        torch.get_num_threads(),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2F] (rows may be strided) -> silu(gate) * up [T, F]."""
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
    _module().fused_silu_mul(native.capsule(gate_up), native.capsule(out), torch.get_num_threads())
    return out
