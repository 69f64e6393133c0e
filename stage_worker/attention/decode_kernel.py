"""The CPU decode-attention kernel (decode_attention.c): one query per sequence over its paged
context, read in place. Used by the torch backend for decodes on CPUs with AVX-512 and its
bf16 instructions (bf16 and float32 caches); anything else keeps the torch path (paged_decode
in torch_backend.py)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from stage_worker import native

SOURCE = Path(__file__).with_name("decode_attention.c")
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
MAX_GROUP = 64
"""Query heads per KV head the kernel takes (Falcon-180B's TP-4 shard has 29)."""
MAX_HEAD_DIM = 256
_enabled = True


def set_enabled(enabled: bool) -> None:
    """Turns the kernel off (the torch path runs), e.g. to time one against the other."""
    global _enabled
    _enabled = enabled


@cache
def _kernel() -> Callable[..., int] | None:
    needs = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
    fn = native.load(SOURCE, "paged_decode_attention", _FLAGS, needs)
    if fn is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float]
    fn.argtypes += [ptr, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    """Whether the kernel is on and loads on this machine."""
    return _enabled and _kernel() is not None


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decodes of q ([B, Hq, D]) over k_cache ([blocks, bs, Hkv, D]) can run here."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (
        _enabled
        and q.device.type == "cpu"
        and q.dtype == k_cache.dtype
        and q.dtype in (torch.bfloat16, torch.float32)
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= MAX_GROUP
        and k_cache.is_contiguous()
        and _kernel() is not None
    )


def scratch_floats(num_q_heads: int, num_kv_heads: int, head_dim: int, max_context: int) -> int:
    """float32 values of scratch the kernel needs for one call: a KV head's scores."""
    return num_q_heads // num_kv_heads * (-(-max_context // 16) * 16)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [blocks, bs, Hkv, D] contiguous; block_table: [B, max_blocks]
    int64 contiguous; context_lens: [B] int64; scratch: float32 of scratch_floats() values
    -> [B, Hq, D] in the caches' dtype. Call only where usable() holds."""
    fn = _kernel()
    assert fn is not None, "paged_decode() called where usable() is False"
    q = q.contiguous()
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    status = fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
        context_lens.data_ptr(), batch, num_q_heads, num_kv_heads, head_dim, block_size,
        block_table.shape[1], head_dim**-0.5, scratch.data_ptr(), out.data_ptr(),
        int(q.dtype == torch.bfloat16),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"decode kernel refused heads {num_q_heads}/{num_kv_heads}x{head_dim}")
    return out
