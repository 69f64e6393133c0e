"""Whether a step's elementwise work (norms, rotary, SiLU-times-up) runs as fused kernels or as
torch's own ops: fused unless turned off (`python -m stage_worker --no-fused-ops`, `sarathictl
bench stage --no-fused-ops`). On CUDA the kernels are Triton's (triton_ops.py); on the CPU the
package's C module's (cpu_fused.py: x86-64 with AVX2 and FMA). Elsewhere, and wherever those
cannot load, torch's ops run.

On CUDA the same switch covers the decode attention of graph-replayed steps
(attention/triton_decode.py: the cache write and the attention as one kernel); `bench stage
--no-decode-kernel` turns that one off alone, to compare."""

from __future__ import annotations

import logging
from functools import cache
from types import ModuleType

import torch

from stage_worker import native

logger = logging.getLogger(__name__)

_enabled = True
_decode_kernel_enabled = True
_cuda: ModuleType | None = None
_cuda_unavailable = False


def set_enabled(on: bool) -> None:
    """On by default; layers consult it at every step."""
    global _enabled
    _enabled = on


def set_decode_kernel_enabled(on: bool) -> None:
    """The Triton decode attention alone (on by default, and only where set_enabled is on)."""
    global _decode_kernel_enabled
    _decode_kernel_enabled = on


def decode_attention_kernel(device: torch.device | str) -> ModuleType | None:
    """attention.triton_decode where graph-replayed decode steps on `device` attend with it,
    else None (torch's paged_decode)."""
    if not (_enabled and _decode_kernel_enabled and torch.device(device).type == "cuda"):
        return None
    if _cuda_kernels() is None:  # no Triton in this torch build
        return None
    from stage_worker.attention import triton_decode

    return triton_decode


def kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The fused ops' module for x's device (functions rms_norm, rotary, silu_mul), or None
    for torch's own ops."""
    if not _enabled or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if x.is_cuda:
        return _cuda_kernels()
    return _cpu_kernels() if x.device.type == "cpu" else None


@cache
def _cpu_kernels() -> ModuleType | None:
    """cpu_fused where the package's C module runs its fused ops, decided once: layers ask at
    every op of every step."""
    if native.fused_kernels() is None:
        return None
    from stage_worker.layers import cpu_fused

    return cpu_fused


def _cuda_kernels() -> ModuleType | None:
    global _cuda, _cuda_unavailable
    if _cuda is None and not _cuda_unavailable:
        try:
            from stage_worker.layers import triton_ops
        except ImportError as e:  # a CUDA torch built without Triton
            logger.warning("fused kernels off: %s; torch's own ops instead", e)
            _cuda_unavailable = True
            return None
        _cuda = triton_ops
    return _cuda
