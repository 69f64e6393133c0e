"""Whether a step's elementwise work (norms, rotary, SiLU-times-up) runs as fused kernels or as
torch's own ops: fused unless turned off (`python -m stage_worker --no-fused-ops`, `sarathictl
bench stage --no-fused-ops`). On CUDA the kernels are Triton's (triton_ops.py); on the CPU the
package's C module's (cpu_fused.py: x86-64 with AVX2 and FMA). Elsewhere, and wherever those
cannot load, torch's ops run."""

from __future__ import annotations

import logging
from functools import cache
from types import ModuleType

import torch

from stage_worker import native

logger = logging.getLogger(__name__)

_enabled = True
_cuda: ModuleType | None = None
_cuda_unavailable = False


def set_enabled(on: bool) -> None:
    """On by default; layers consult it at every step."""
    global _enabled
    _enabled = on


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
