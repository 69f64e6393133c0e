"""bf16 linear layers on the CPU through the package's AVX-512 kernel
(stage_worker/csrc/matmul_bf16_avx512.c): decode steps, and where a worker measured it the
faster one, every step.

oneDNN's packed bf16 matmul, which the layers run otherwise, reads a decode step's weights at
22-32 GB/s on the 2-core Zen 5 EPYC, and its time grows with the tokens well before the
arithmetic limits it (8.4 ms for the demo model's layers at 12 tokens against 6.7 at one). The
kernel streams its own panels, asking for each line 8 KiB ahead: 1.3x-1.5x oneDNN's speed at
one token, 1.5x-2x at 8 to 16 (BENCHMARKS "A bf16 matmul for decode steps"); on steps of many
tokens it takes four panels against six tokens at once, which holds 0.93x-1.1x oneDNN's speed
up to 512 tokens, at the demo model's widths and a 7B model's alike (BENCHMARKS "The bf16
kernel at every step size"). Until a worker has measured its CPU,
steps of more than MAX_TOKENS run oneDNN; after, up to the reach it measured (REACH,
matmul_bf16_dispatch.py: a CPU with AMX may run oneDNN faster from a few tokens), which may be
UNBOUNDED. Each bf16 weight is held twice, as panels and in oneDNN's layout, except where the
reach is unbounded: then it is packed as panels only.
An LM head takes the kernel's float32 sums unrounded (no near-ties made exact ties: see
exact_logits.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from stage_worker import native
from stage_worker.layers import cpu_matmul

MAX_TOKENS = 64
"""Steps of up to this many tokens run the kernel, larger ones oneDNN (module docstring), until
a worker has measured its CPU (REACH): the kernel's lead on the one CPU it was first measured
on, kept where nothing was measured."""

UNBOUNDED = sys.maxsize
"""A reach that takes every step: the kernel won at every size measured."""


@dataclass
class Reach:
    """Up to how many tokens the layers run the kernel: MAX_TOKENS, or what the worker measured
    on this CPU before it loaded its weights (matmul_bf16_dispatch.py), which their layouts
    follow (ShardedLinear.pack): panels at a reach of 0 are not made, and at UNBOUNDED they are
    the only ones."""

    max_tokens: int = MAX_TOKENS

    def takes_every_step(self) -> bool:
        """Whether the kernel runs every step, so that a weight needs no other layout."""
        return self.max_tokens == UNBOUNDED


REACH = Reach()


@dataclass(frozen=True)
class PackedBf16:
    """A [out, in] bf16 weight as the kernel reads it."""

    panels: torch.Tensor
    """[ceil(out / 16), ceil(in / 2), 16, 2] bf16: output features in panels of 16, each pair
    of inputs side by side, zero-padded."""
    out_features: int
    in_features: int


def usable_for(weight: torch.Tensor) -> bool:
    """Whether weight ([out, in]) may be packed for the kernel (how, the reach says: pack()
    in linear.py), decided once at load."""
    return (
        cpu_matmul.enabled()
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and native.kernels() is not None
    )


def pack(weight: torch.Tensor) -> PackedBf16:
    """weight: [out, in] bf16 -> its panels (a new tensor; weight is left as it is)."""
    module = native.kernels()
    assert module is not None, "pack() called where usable_for() is False"
    out, in_ = weight.shape
    panels = torch.empty((-(-out // 16), -(-in_ // 2), 16, 2), dtype=torch.bfloat16)
    module.matmul_bf16_pack(native.capsule(weight.contiguous()), native.capsule(panels))
    return PackedBf16(panels, out, in_)


def linear(
    x: torch.Tensor, weight: PackedBf16, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """x: [n, in] bf16 (rows may be strided) -> [n, out] = x @ weight.T, on torch's intra-op
    thread count: bf16, or float32 (the float32 sums unrounded: an LM head's logits)."""
    module = native.kernels()
    assert module is not None, "linear() called where usable_for() is False"
    if x.shape[-1] != weight.in_features:  # the panels hold pairs: k and k + 1 look alike there
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.in_features} inputs")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((x.shape[0], weight.out_features), dtype=out_dtype)
    module.matmul_bf16(
        native.capsule(x), native.capsule(weight.panels), native.capsule(y), torch.get_num_threads()
    )
    return y
