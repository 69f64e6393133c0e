"""The KV cache is zeroed a chunk at a time with a progress call after each, so a worker whose
large cache takes seconds to zero keeps heartbeating (it was taken for dead and restarted in a
loop with `--kv-cache-mb 8192` on a 2-core VM)."""

from __future__ import annotations

import pytest
import torch

from stage_worker import kv_cache
from stage_worker.kv_cache import KVCache


def test_cache_is_zeroed_in_chunks_with_progress_between(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "ZERO_CHUNK_BYTES", 1024)
    calls = []
    cache = KVCache(
        num_layers=2, num_blocks=7, block_size=4, kv_heads=2, head_dim=8,
        device="cpu", dtype=torch.bfloat16, progress=lambda: calls.append(1),
    )  # fmt: skip
    # [layers, K/V, blocks + scratch, block_size, heads, head_dim]
    assert cache.data.shape == (2, 2, 8, 4, 2, 8)
    nbytes = cache.data.numel() * cache.data.element_size()
    assert nbytes == 4096 and len(calls) == 4
    assert bool((cache.data == 0).all())


def test_no_progress_callback_needed() -> None:
    cache = KVCache(2, 3, 4, 1, 8, "cpu", torch.float32)
    assert bool((cache.data == 0).all())
