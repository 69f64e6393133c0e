"""Column- and row-parallel linear layers without bias (none of the supported models uses one).

Column-parallel: the rank holds output rows [out_local, in]; its output is its share of the
features and needs no communication. Row-parallel: the rank holds input columns
[out, in_local]; its output is a partial sum the caller all-reduces over the TP group (the model
calls `tp.all_reduce` itself, so the collective is visible where it happens).
After loading, `pack()` swaps a CPU float32 weight for the panels of the package's AVX2 matmul
kernel (cpu_matmul.py), or a CPU bf16 weight for its oneDNN-blocked form (see onednn.py), and
keeps it also as the package's bf16 panels for steps of a few tokens (matmul_bf16.py; where
that kernel is off, plain for the opt-in small-batch kernel, gemv.py): as far as the bf16
kernel's reach, which a worker measures before it loads. Where that kernel takes every step, a
bf16 weight is held once, as its panels.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from stage_worker.layers import cpu_matmul, gemv, matmul_bf16, onednn


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    plain: torch.Tensor | None = None,
    bf16: matmul_bf16.PackedBf16 | None = None,
) -> torch.Tensor:
    """x: [n, in] @ weight ([out, in], strided or oneDNN-packed).T -> [n, out]; plain: the same
    weight row-major for the opt-in small-batch GEMV kernel (gemv.py), or None; bf16: the same
    as the bf16 kernel's panels (matmul_bf16.py), or None. Each kernel takes the steps it is
    fastest at."""
    n = x.shape[0]
    if bf16 is not None and n <= matmul_bf16.REACH.max_tokens:
        return matmul_bf16.linear(x, bf16)
    if plain is not None and n <= gemv.MAX_TOKENS:
        return gemv.linear(x, plain)
    return onednn.linear(x, weight)


class LinearClock:
    """Wall seconds spent in every ShardedLinear.forward, summed while `on`: the linear layers'
    share of a worker's step (stage_worker/step_timer.py). Off by default, where a layer pays
    one attribute read; on, two clock readings (well under 1% of a decode step)."""

    __slots__ = ("on", "seconds")

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0


CLOCK = LinearClock()


class ShardedLinear(nn.Module):
    """A rank's [out, in] share of a linear weight, fast-pathed on the CPU after pack()."""

    def __init__(self, out: int, in_: int, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = out, in_
        """The weight's [out, in], whatever layout pack() later holds it in."""
        # weight: [out, in_]
        self.weight = nn.Parameter(
            torch.empty(out, in_, device=device, dtype=dtype), requires_grad=False
        )
        self.plain: torch.Tensor | None = None
        """The weight row-major for gemv.linear, when the small-batch kernel is on."""
        self.bf16: matmul_bf16.PackedBf16 | None = None
        """The weight as the bf16 kernel's panels, for the steps of its reach
        (matmul_bf16.REACH), once packed."""
        self.f32: cpu_matmul.PackedWeight | None = None
        """The weight as the float32 kernel's panels (then also `weight`), once packed."""
        self.panels_only = False
        """Whether `bf16` is the only layout held (then also `weight`): every step runs the
        bf16 kernel, whatever matmul_bf16.REACH says later."""

    def pack(self) -> None:
        """After load: the weight in the layout of the fastest kernel for it (no-op where
        F.linear is that)."""
        if cpu_matmul.usable_for(self.weight.data):
            self.f32 = cpu_matmul.pack(self.weight.data)
            self.weight = nn.Parameter(self.f32.panels, requires_grad=False)  # plain one freed
            return
        if matmul_bf16.usable_for(self.weight.data) and matmul_bf16.REACH.max_tokens > 0:
            self.bf16 = matmul_bf16.pack(self.weight.data)
            if matmul_bf16.REACH.takes_every_step():  # held once, as panels
                self.weight = nn.Parameter(self.bf16.panels, requires_grad=False)
                self.panels_only = True
                return
        if gemv.usable_for(self.weight.data):
            self.plain = self.weight.data  # for the GEMV kernel; oneDNN gets its own copy
        if onednn.can_pack(self.weight):
            self.weight = nn.Parameter(onednn.pack(self.weight.data), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_] -> [num_tokens, out]
        clock = CLOCK
        if not clock.on:
            return self.matmul(x)
        start = time.perf_counter()
        out = self.matmul(x)
        clock.seconds += time.perf_counter() - start
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """forward() without the clock: x [num_tokens, in_] -> [num_tokens, out]."""
        if self.f32 is not None:
            return cpu_matmul.linear(x, self.f32)
        if self.panels_only:
            assert self.bf16 is not None
            return matmul_bf16.linear(x, self.bf16)
        return linear(x, self.weight, self.plain, self.bf16)


class ColumnParallelLinear(ShardedLinear):
    def __init__(self, in_features: int, out_local: int, device: str, dtype: torch.dtype) -> None:
        # weight: [out_local, in_features]; the output is this rank's share of the features
        super().__init__(out_local, in_features, device, dtype)

    def load(self, rows: torch.Tensor) -> None:
        """rows: [out_local, in_features], this rank's rows of the full weight."""
        self.weight.data.copy_(rows)


class RowParallelLinear(ShardedLinear):
    def __init__(self, in_local: int, out_features: int, device: str, dtype: torch.dtype) -> None:
        # weight: [out_features, in_local]; the output is a partial sum to all-reduce
        super().__init__(out_features, in_local, device, dtype)

    def load(self, cols: torch.Tensor) -> None:
        """cols: [out_features, in_local], this rank's columns of the full weight."""
        self.weight.data.copy_(cols)
