"""Fused elementwise kernels for CUDA steps, in Triton: RMSNorm (with the residual add before it,
or without), rotary, SiLU-and-multiply.

Why: eager torch runs a Llama layer's elementwise work as about twenty small kernels (a norm
alone is an upcast, the norm, a downcast and the scale). At decode batch sizes each is a few
microseconds of launch and tail for almost no bytes, and 32 layers of them cost a 7B model on an
H200 as much as reading its weights does (BENCHMARKS.md, GPU section). Each kernel here is one
launch where torch needed two to five.

Each rounds where the eager path rounds: a product or sum the reference computes in the model
dtype is rounded to it here too, so rotary and SiLU-times-up give the eager path's values (up to
`exp`'s last bit), and RMSNorm differs only in the order of its float32 sum.

Imported only on CUDA (fused.py): Triton ships with torch's CUDA builds, not its CPU ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, sum_ptr, w_ptr, out_ptr, x_row_stride, delta_row_stride, out_row_stride,
    hidden, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # one program per token row: x [hidden] (+ delta, stored as sum) -> out [hidden]
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to dtype as torch's add rounds it
        delta = tl.load(delta_ptr + row * delta_row_stride + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * out_row_stride + cols, x, mask=inside)
    x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden
    normed = (x * tl.rsqrt(mean_square + eps)).to(dtype).to(tl.float32)  # as the reference
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (w * normed).to(dtype), mask=inside)


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    x_token_stride,
    x_head_stride,
    cos_sin_stride,
    heads,
    half,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # one program per token: x [heads, 2 * half] (strided) -> out [heads, 2 * half] contiguous
    token = tl.program_id(0)
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    inside = (h < heads) & (d < half)
    src = x_ptr + token * x_token_stride + h * x_head_stride + d
    x1 = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=inside, other=0.0).to(tl.float32)
    cs = token * cos_sin_stride + d
    c1 = tl.load(cos_ptr + cs, mask=d < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + half, mask=d < half, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=d < half, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + half, mask=d < half, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # the reference: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to dtype
    o1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    dst = out_ptr + token * heads * 2 * half + h * 2 * half + d
    tl.store(dst, o1.to(dtype), mask=inside)
    tl.store(dst + half, o2.to(dtype), mask=inside)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_row_stride, width, BLOCK: tl.constexpr):
    # program (row, block): x [2 * width] = gate | up -> out [width]
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + width + cols, mask=inside, other=0.0)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # silu(gate), rounded
    tl.store(out_ptr + row * width + cols, (silu * up.to(tl.float32)).to(dtype), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] (rows may be strided), weight: [H] -> weight * rms_norm(x) [T, H] in x's dtype."""
    return _rms_norm(x, None, weight, eps)[1]


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [T, H] (rows may be strided), weight: [H] -> (x + delta, weight *
    rms_norm(x + delta)), each [T, H] in x's dtype: a residual add and the norm after it in one
    kernel."""
    if delta.shape != x.shape or delta.dtype != x.dtype or delta.stride(1) != 1:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} must match x {tuple(x.shape)}")
    total, out = _rms_norm(x, delta, weight, eps)
    assert total is not None
    return total, out


def _rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    tokens, hidden = x.shape
    if x.stride(1) != 1 or weight.shape != (hidden,):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} with unit column stride, weight [{hidden}]")
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    total = None if delta is None else torch.empty_like(out)
    block = triton.next_power_of_2(hidden)
    if tokens:
        _rms_norm_kernel[(tokens,)](
            x, x if delta is None else delta, out if total is None else total, weight, out,
            x.stride(0), x.stride(0) if delta is None else delta.stride(0), out.stride(0),
            hidden, eps, HAS_DELTA=delta is not None,
            BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return total, out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (token and head strides free, D contiguous); cos, sin: [T, 1, D]
    contiguous -> x rotated (rotate-half form), [T, heads, D] contiguous."""
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or head_dim % 2 or cos.shape != (tokens, 1, head_dim):
        raise ValueError(
            f"rotary: x {tuple(x.shape)} with contiguous even head_dim, cos {tuple(cos.shape)}"
        )
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens:
        half = head_dim // 2
        _rotary_kernel[(tokens,)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), heads, half,
            BLOCK_HEADS=triton.next_power_of_2(heads), BLOCK_HALF=triton.next_power_of_2(half),
            enable_fp_fusion=False,  # no multiply-add contraction: round each product as torch does
        )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2F] (rows may be strided) -> silu(gate) * up [T, F]."""
    tokens, double_width = gate_up.shape
    if gate_up.stride(1) != 1 or double_width % 2:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)}, even width, unit stride")
    width = double_width // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), width, BLOCK=block
        )
    return out
