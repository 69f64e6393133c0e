"""A bf16 matrix-vector kernel for CPU decode steps (stage_worker/csrc/gemv_bf16.c).

One-token matmuls stream weights at 9-14 GB/s through oneDNN on one AVX512-BF16 core, well
under what the core can read (about 26 GB/s), and they are most of a decode step. The C kernel
reads each weight once, in address order, for the step's one or two tokens. It is compiled
into stage_worker._kernels with the package (stage_worker/native.py) and used only where it can
run: a CPU with AVX-512 and its bf16 instructions, one torch thread per worker (the kernel is
single-threaded; with more threads oneDNN is left to use them). Anything else falls back to
oneDNN, with the reason logged once.

Opt-in (`python -m stage_worker --small-batch-kernel`, `sarathictl bench stage
--small-batch-kernel`): the kernel reads plain row-major weights while oneDNN, which stays
faster from 3 tokens up, reads its own blocked copy, so each bf16 linear weight is held twice
(a tied LM head reuses the embedding's rows and costs nothing extra). Superseded by the bf16
matmul kernel (matmul_bf16.py), which runs on the same CPUs on every thread and for up to 64
tokens: this one runs only where that one is off (`--no-cpu-matmul-kernel`).
"""

from __future__ import annotations

import torch

from stage_worker import native
from stage_worker.layers import matmul_bf16

MAX_TOKENS = 2
"""Steps of up to this many tokens use the kernel; from 3 tokens oneDNN's packed kernel is as
fast or faster (measured on the demo model, BENCHMARKS.md)."""
_enabled = False


def enable() -> None:
    """Lets layers loaded from now on use the kernel where it can run (see usable_for)."""
    global _enabled
    _enabled = True


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
        and native.kernels() is not None
        and not matmul_bf16.usable_for(weight)  # superseded where that kernel runs
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [m, in] bf16 (m <= MAX_TOKENS to be worth it), weight: [out, in] contiguous bf16 ->
    [m, out] bf16. The module refuses (ValueError) shapes or dtypes that do not match."""
    module = native.kernels()
    assert module is not None, "linear() called where usable_for() is False"
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)
    module.gemv_bf16(native.capsule(x.contiguous()), native.capsule(weight), native.capsule(y))
    return y
