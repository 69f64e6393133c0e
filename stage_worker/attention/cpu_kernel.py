"""The CPU attention kernel (stage_worker/csrc/paged_attention.c): every query token of a step
over its own paged context (a decode's sequence, a prompt token's causal prefix), read in place,
the (token, KV head) pairs shared out among the worker's threads. The torch backend runs whole
steps on it on CPUs with AVX-512 and its bf16 instructions (bf16 and float32 caches), and on
CPUs with AVX2 and FMA for float32 caches (paged_attention_avx2.c); anything else keeps the
torch path (SDPA per prefill chunk, paged_decode for decodes)."""

from __future__ import annotations

import torch

from stage_worker import native

MAX_GROUP = 64
"""Query heads per KV head the kernel takes (Falcon-180B's TP-4 shard has 29)."""
MAX_HEAD_DIM = 256
_enabled = True


def set_enabled(enabled: bool) -> None:
    """Turns the kernel on or off (off: the torch path runs), e.g. to time one against the
    other; steps prepared from then on follow it."""
    global _enabled
    _enabled = enabled


def available() -> bool:
    """Whether the kernel is on and runs on this machine (for float32 caches at least)."""
    return _enabled and native.fused_kernels() is not None


def takes_dtype(dtype: torch.dtype) -> bool:
    """float32 wherever the kernel runs; bf16 only on the AVX-512 kernel."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native.kernels() is not None)


def takes_heads(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel is available and takes this head layout in this dtype: a step it
    will not run is not prepared for it (a bf16 model on a CPU with AVX2 alone)."""
    return (
        head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= MAX_GROUP
        and available()
        and takes_dtype(dtype)
    )


def takes_tensors(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel reads q ([T, Hq, D]) and k_cache ([blocks, bs, Hkv, D]) as they are
    (their heads already checked by takes_heads when the step was prepared): once per layer,
    so only what can differ from the step's preparation is looked at."""
    return q.dtype == k_cache.dtype and takes_dtype(q.dtype) and k_cache.is_contiguous()


def scratch_floats(num_q_heads: int, num_kv_heads: int, max_context: int, threads: int) -> int:
    """float32 values of scratch one call needs: for each thread, the scores of one tile of a
    chunk's tokens, as the module reckons it (sarathi_attention_scratch_floats, csrc/kernels.h)."""
    per_thread: int = native.module().attention_scratch_floats(
        num_q_heads, num_kv_heads, max_context
    )
    return threads * per_thread


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scratch: torch.Tensor,
    threads: int,
) -> torch.Tensor:
    """q: [T, Hq, D], one row per query token; caches: [blocks, bs, Hkv, D] contiguous;
    block_table: [T, max_blocks] int64 contiguous, each token's sequence's table; context_lens:
    [T] int64, the positions each token attends; scratch: float32 of scratch_floats() values for
    `threads` threads -> [T, Hq, D] in the caches' dtype. Call only where takes_heads() and
    takes_tensors() hold; the module refuses (ValueError) anything it would read out of
    bounds."""
    module = native.fused_kernels()  # the module, where either kernel runs (module.c picks)
    assert module is not None, "attend() called where the kernel is not available"
    q = q.contiguous()
    out = torch.empty_like(q)
    capsule = native.capsule
    module.paged_attention(
        capsule(q), capsule(k_cache), capsule(v_cache), capsule(block_table),
        capsule(context_lens), capsule(scratch), capsule(out), q.shape[2] ** -0.5, threads,
    )  # fmt: skip
    return out
