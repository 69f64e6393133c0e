"""The worker's C kernels (stage_worker/csrc), compiled into the extension module
stage_worker._kernels when the package is built: no compiler runs on a serving node.

Where the module cannot run (an install built without it, another architecture, a CPU without
AVX-512 and its bf16 instructions) `kernels()` is None, the reason is logged once, and each
caller keeps its torch path. Its fused elementwise ops, its float32 matmul and its float32
attention need only AVX2 and FMA: `fused_kernels()` says whether they run. The module checks
every tensor it is handed (dtype, shape, contiguity, block-table entries) and raises ValueError
naming the argument rather than read out of bounds.
"""

from __future__ import annotations

import logging
from functools import cache
from types import ModuleType

import torch  # first: the module then shares torch's OpenMP runtime (the same libgomp soname)

logger = logging.getLogger(__name__)


def module() -> ModuleType:
    """stage_worker._kernels whether or not this CPU runs its kernels (its argument checks and
    sizes run anywhere); ImportError in an install built without it."""
    from stage_worker import _kernels  # type: ignore[attr-defined]

    return _kernels


@cache
def kernels() -> ModuleType | None:
    """stage_worker._kernels where it runs on this machine, else None (the reason logged
    once)."""
    try:
        loaded = module()
    except ImportError as err:
        logger.warning(
            "the C kernels are not in this install (%s); the torch path runs instead. "
            "Reinstall the package on a machine with a C compiler to build them.",
            err,
        )
        return None
    if not loaded.cpu_supported():
        logger.info(
            "this CPU lacks AVX-512 with bf16: its bf16 kernels stay off (the AVX2 ones, for "
            "float32, still run where the CPU has AVX2)"
        )
        return None
    logger.info("C kernels loaded from %s (OpenMP: %s)", loaded.__file__, loaded.openmp())
    return loaded


@cache
def fused_kernels() -> ModuleType | None:
    """stage_worker._kernels where its fused elementwise ops run (x86-64 with AVX2 and FMA;
    the AVX-512 kernels need not), else None (the reason logged once)."""
    try:
        loaded = module()
    except ImportError as err:
        logger.warning("the C kernels are not in this install (%s); torch's own ops run", err)
        return None
    if not loaded.fused_supported():
        logger.info("this CPU lacks AVX2 with FMA; the fused ops stay off, torch's ops run")
        return None
    return loaded


def capsule(tensor: torch.Tensor) -> object:
    """tensor as the DLPack capsule the kernels read (no copy)."""
    return torch.utils.dlpack.to_dlpack(tensor)
