"""Whether a step's elementwise work runs as fused Triton kernels (triton_ops.py) or as torch's
own ops: fused on CUDA unless turned off (`python -m stage_worker --no-fused-ops`, `sarathictl
bench stage --no-fused-ops`); torch's ops on the CPU, and wherever Triton cannot be imported."""

from __future__ import annotations

import logging
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_enabled = True
_kernels: ModuleType | None = None
_unavailable = False


def set_enabled(on: bool) -> None:
    """On by default; layers consult it at every step."""
    global _enabled
    _enabled = on


def kernels_for(x: torch.Tensor) -> ModuleType | None:
    """triton_ops when x's step should use it, else None (torch's ops)."""
    global _kernels, _unavailable
    if not (_enabled and x.is_cuda) or _unavailable:
        return None
    if _kernels is None:
        try:
            from stage_worker.layers import triton_ops
        except ImportError as e:  # a CUDA torch built without Triton
            logger.warning("fused kernels off: %s; torch's own ops instead", e)
            _unavailable = True
            return None
        _kernels = triton_ops
    return _kernels
