"""Paged KV cache of one worker's layers: K and V per layer as
[num_blocks + 1, block_size, kv_heads_local, head_dim]. Slot s of the flattened view is token
s % block_size of block s // block_size. Block num_blocks is scratch, never handed to a
sequence: the padding rows of a replayed CUDA graph write their K and V there (cuda_graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# Share of free GPU memory (after the weights are loaded) the cache may take; the rest is left to
# activations, the NCCL buffers and the attention workspace.
GPU_CACHE_FRACTION = 0.85

ZERO_CHUNK_BYTES = 256 << 20
"""The cache is zeroed this much at a time, with a call to `progress` after each: a large CPU
cache takes seconds to fault in and zero (8 GiB took 30 s on a 2-core VM), which must not pass
for a dead worker (the controller's heartbeat timeout is 5 s)."""


def bytes_per_block(
    num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * kv_heads * head_dim * element_bytes


def num_blocks_that_fit(
    device: str,
    per_block_bytes: int,
    cpu_budget_bytes: int,
    gpu_fraction: float = GPU_CACHE_FRACTION,
) -> int:
    """Blocks from free GPU memory (cuda) or the configured budget (cpu), less the scratch
    block every cache holds."""
    if device.startswith("cuda"):
        free_bytes, _total = torch.cuda.mem_get_info(torch.device(device))
        budget = int(free_bytes * gpu_fraction)
    else:
        budget = cpu_budget_bytes
    return max(0, budget // per_block_bytes - 1)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        device: str,
        dtype: torch.dtype,
        progress: Callable[[], None] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        """Blocks the scheduler may hand out: ids 0 .. num_blocks - 1."""
        self.block_size = block_size
        self.scratch_block = num_blocks
        # [num_layers, 2 (K, V), num_blocks + 1 (scratch), block_size, kv_heads, head_dim]
        self.data = torch.empty(
            num_layers,
            2,
            num_blocks + 1,
            block_size,
            kv_heads,
            head_dim,
            device=device,
            dtype=dtype,
        )
        # Zeros, not garbage: the padded decode path reads slots no token wrote (masked, but a
        # masked NaN still poisons the weighted sum of V: 0 * NaN = NaN).
        flat = self.data.view(-1)
        chunk = max(1, ZERO_CHUNK_BYTES // self.data.element_size())
        for start in range(0, flat.numel(), chunk):
            flat[start : start + chunk].zero_()
            if progress is not None:
                progress()
        logger.info(
            "KV cache: %d blocks x %d tokens, %.1f MiB",
            num_blocks,
            block_size,
            self.data.numel() * self.data.element_size() / 2**20,
        )

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Block dst[i] becomes a copy of block src[i], K and V of every layer (copy-on-write
        of a forked sequence's partial block)."""
        device = self.data.device
        src_t = torch.tensor(src, dtype=torch.int64, device=device)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=device)
        # [num_layers, 2, len(src), block_size, kv_heads, head_dim]
        self.data[:, :, dst_t] = self.data[:, :, src_t]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of local layer `index`: each [num_blocks + 1, block_size, kv_heads, head_dim]."""
        return self.data[index, 0], self.data[index, 1]
