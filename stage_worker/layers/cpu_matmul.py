"""float32 linear layers on the CPU through the package's AVX2 matmul kernel
(stage_worker/csrc/sgemm_f32.c).

torch's float32 `F.linear` runs MKL, which on the AMD EPYC without AVX-512 reads a decode
step's weights at 5-13 GB/s and makes a step of 2 to 8 tokens cost about twice one token's; the
kernel reads them once per step at 15-17 GB/s for up to 6 tokens and stays ahead of MKL up to
128 (BENCHMARKS "A float32 matmul kernel for AVX2"). It needs its own weight layout, panels of
16 outputs, so each float32 weight is packed once after load and the plain copy dropped.

A float32 weight whose every value is a bf16 value (a bf16 checkpoint served in float32, as on
CPUs without bf16 arithmetic) is packed as bf16: half the bytes to read, widened to the same
float32 in registers, so the products are the float32 kernel's to the bit. Steps that stream the
weights (decodes, small batches) read half as much; the memory footprint halves too.

On by default wherever it runs (x86-64 with AVX2 and FMA, the package's C module built);
`--no-cpu-matmul-kernel` on the worker and on `sarathictl bench stage` keeps MKL, to compare.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stage_worker import native

PANEL = 16
"""Outputs per panel of the packed layout (SARATHI_SGEMM_PANEL in kernels.h)."""

_enabled = True


def set_enabled(on: bool) -> None:
    """On by default; decides the layers loaded from now on, for this kernel and for the bf16
    one (matmul_bf16.py): `--no-cpu-matmul-kernel` turns both off."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


BF16_POSITION = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
"""Where a panel's output c sits in a bf16 panel's row: the order in which the kernel's two
128-bit-lane unpacks widen it to outputs 0-7 and 8-15 (sgemm_f32.c, panel_row)."""


@dataclass(frozen=True)
class PackedWeight:
    """A [out, in] float32 weight as the kernel reads it."""

    panels: torch.Tensor
    """[ceil(out / 16), in, 16] float32 or bfloat16 (see holds_bf16_values): output features in
    panels of 16, zero-padded; a bf16 panel's 16 in BF16_POSITION order."""
    out_features: int


def usable_for(weight: torch.Tensor) -> bool:
    """Whether weight ([out, in]) should be packed for the kernel, decided once at load."""
    return (
        _enabled
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and native.fused_kernels() is not None
    )


def holds_bf16_values(weight: torch.Tensor) -> bool:
    """Whether every value of the float32 weight is a bf16 value (its low 16 bits zero), so
    that bf16 panels hold it exactly."""
    return not bool((weight.contiguous().view(torch.int32) & 0xFFFF).any())


def pack(weight: torch.Tensor, bf16_where_exact: bool = True) -> PackedWeight:
    """weight: [out, in] float32 -> its panels (a new tensor; weight is left as it is), bf16
    where that loses nothing unless `bf16_where_exact` is off (to compare the two)."""
    module = native.fused_kernels()
    assert module is not None, "pack() called where usable_for() is False"
    out, in_ = weight.shape
    bf16 = bf16_where_exact and holds_bf16_values(weight)
    dtype = torch.bfloat16 if bf16 else torch.float32
    panels = torch.empty((-(-out // PANEL), in_, PANEL), dtype=dtype)
    module.sgemm_f32_pack(native.capsule(weight.contiguous()), native.capsule(panels))
    return PackedWeight(panels, out)


def rows(weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """The weight's rows ids ([n] int64, each < out_features) -> [n, in] float32: an embedding
    lookup in a tied matrix held only as panels."""
    column = ids % PANEL
    if weight.panels.dtype == torch.bfloat16:
        column = BF16_POSITION[column]
    return weight.panels[ids // PANEL, :, column].float()  # the index dims first: [n, in]


def linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x: [n, in] float32 (rows may be strided) -> [n, out] float32 = x @ weight.T, on torch's
    intra-op thread count."""
    module = native.fused_kernels()
    assert module is not None, "linear() called where usable_for() is False"
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((x.shape[0], weight.out_features), dtype=torch.float32)
    module.sgemm_f32(
        native.capsule(x), native.capsule(weight.panels), native.capsule(y), torch.get_num_threads()
    )
    return y
