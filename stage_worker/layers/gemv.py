"""A bf16 matrix-vector kernel for CPU decode steps (gemv_bf16.c), built on first use.

One-token matmuls stream weights at 9-14 GB/s through oneDNN on one AVX512-BF16 core, well
under what the core can read (about 26 GB/s), and they are most of a decode step. The C kernel
reads each weight once, in address order, for the step's one or two tokens. It is compiled
with the system's C compiler into a per-user cache the first time a worker asks for it (well
under a second), and used only where it can run: Linux on a CPU with avx512_bf16, a C compiler
present, one torch thread per worker (the kernel is single-threaded; with more threads oneDNN is
left to use them). Anything else falls back to oneDNN, with the reason logged once.

Opt-in (`python -m stage_worker --small-batch-kernel`, `sarathictl bench stage
--small-batch-kernel`): the kernel reads plain row-major weights while oneDNN, which stays
faster from 3 tokens up, reads its own blocked copy, so each bf16 linear weight is held twice
(a tied LM head reuses the embedding's rows and costs nothing extra).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from stage_worker import native

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv_bf16.c")
MAX_TOKENS = 2
"""Steps of up to this many tokens use the kernel; from 3 tokens oneDNN's packed kernel is as
fast or faster (measured on the demo model, BENCHMARKS.md)."""
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16")
_enabled = False


def enable() -> None:
    """Lets layers loaded from now on use the kernel where it can run (see usable_for)."""
    global _enabled
    _enabled = True


@cache
def _kernel() -> Callable[..., None] | None:
    """The loaded kernel, or None (reason logged) where it cannot run."""
    fn = native.load(SOURCE, "gemv_bf16", _FLAGS, needs=("avx512_bf16",))
    if fn is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64]
    fn.restype = None
    return fn


def usable_for(weight: torch.Tensor) -> bool:
    """Whether decode steps against weight ([out, in]) should run the kernel, decided once at
    load time."""
    return (
        _enabled
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and torch.get_num_threads() == 1
        and _kernel() is not None
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [m, in] bf16 (m <= MAX_TOKENS to be worth it), weight: [out, in] contiguous bf16 ->
    [m, out] bf16."""
    fn = _kernel()
    assert fn is not None, "linear() called where usable_for() is False"
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w or x.dtype != torch.bfloat16:
        raise ValueError(f"x is {x.dtype} with {k} features; the weight takes bf16 with {k_w}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=torch.bfloat16)
    fn(x.data_ptr(), m, x.stride(0), weight.data_ptr(), n, k, y.data_ptr(), y.stride(0))
    return y
