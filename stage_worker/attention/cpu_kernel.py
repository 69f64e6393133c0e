"""The CPU attention kernel (paged_attention.c): every query token of a step over its own paged
context (a decode's sequence, a prompt token's causal prefix), read in place. The torch backend
runs whole steps on it on CPUs with AVX-512 and its bf16 instructions (bf16 and float32
caches); anything else keeps the torch path (SDPA per prefill chunk, paged_decode for
decodes)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from stage_worker import native

SOURCE = Path(__file__).with_name("paged_attention.c")
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
MAX_GROUP = 64
"""Query heads per KV head the kernel takes (Falcon-180B's TP-4 shard has 29)."""
MAX_HEAD_DIM = 256
_enabled = True


def set_enabled(enabled: bool) -> None:
    """Turns the kernel on or off (off: the torch path runs), e.g. to time one against the
    other; steps prepared from then on follow it."""
    global _enabled
    _enabled = enabled


@cache
def _kernel() -> Callable[..., int] | None:
    needs = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
    fn = native.load(SOURCE, "paged_attention", _FLAGS, needs)
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


def takes_heads(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel is available and takes this head layout."""
    return (
        head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= MAX_GROUP
        and available()
    )


def takes_tensors(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel reads q ([T, Hq, D]) and k_cache ([blocks, bs, Hkv, D]) as they are
    (their heads already checked by takes_heads when the step was prepared): once per layer,
    so only what can differ from the step's preparation is looked at."""
    return (
        q.dtype == k_cache.dtype
        and q.dtype in (torch.bfloat16, torch.float32)
        and k_cache.is_contiguous()
    )


def scratch_floats(num_q_heads: int, num_kv_heads: int, max_context: int) -> int:
    """float32 values of scratch the kernel needs for one call: a KV head's scores."""
    return num_q_heads // num_kv_heads * (-(-max_context // 16) * 16)


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """q: [T, Hq, D], one row per query token; caches: [blocks, bs, Hkv, D] contiguous;
    block_table: [T, max_blocks] int64 contiguous, each token's sequence's table; context_lens:
    [T] int64, the positions each token attends; scratch: float32 of scratch_floats() values
    -> [T, Hq, D] in the caches' dtype. Call only where takes_heads() and takes_tensors()
    hold."""
    fn = _kernel()
    assert fn is not None, "attend() called where the kernel is not available"
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
        raise ValueError(f"attention kernel refused heads {num_q_heads}/{num_kv_heads}x{head_dim}")
    return out
