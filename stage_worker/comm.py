"""Communication of one worker: its TP group (a stage's ranks) and the point-to-point links to
the same TP rank of the previous and next stage. NCCL on CUDA, gloo on CPU; gloo on CUDA too
when asked (several workers sharing one GPU, which NCCL refuses), the activations then crossing
through host memory.

Ranks are laid out stage-major: global rank = stage * tp + tp_rank.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from stage_worker.config import ShardSpec

logger = logging.getLogger(__name__)


class TPGroup:
    """Collectives over the TP ranks of one stage; every call is a no-op when tp == 1."""

    def __init__(
        self, size: int = 1, rank: int = 0, group: dist.ProcessGroup | None = None
    ) -> None:
        self.size = size
        self.rank = rank
        self._group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self._group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, k] on every rank -> [n, size * k], rank order along the last dim."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self._group)
        return torch.cat(parts, dim=-1)


class PipelineLinks:
    """Sends a stage's activations to the next stage's rank of the same TP index and receives
    from the previous one. With send_slices each TP rank ships only its 1/tp of the hidden
    features and the receiving stage all-gathers them over its TP group (less network traffic
    between nodes, one extra intra-node collective)."""

    def __init__(
        self, shard: ShardSpec, tp_group: TPGroup, send_slices: bool, via_host: bool = False
    ) -> None:
        self.shard = shard
        self.tp_group = tp_group
        self.send_slices = send_slices and shard.tp > 1
        self.via_host = via_host
        """gloo moves host tensors only: copy CUDA activations to and from host memory."""
        self._pending: list[tuple[object, torch.Tensor]] = []

    def _slice_width(self, hidden_size: int) -> int:
        if hidden_size % self.shard.tp:
            raise ValueError(f"hidden_size={hidden_size} not divisible by tp={self.shard.tp}")
        return hidden_size // self.shard.tp

    def send(self, hidden: torch.Tensor) -> None:
        """hidden: [num_tokens, hidden_size]; asynchronous, so compute can go on meanwhile."""
        self.wait_sends()
        if self.send_slices:
            width = self._slice_width(hidden.shape[1])
            start = self.shard.tp_rank * width
            hidden = hidden[:, start : start + width]
        buf = hidden.to("cpu") if self.via_host else hidden.contiguous()
        dst = self.shard.global_rank + self.shard.tp
        self._pending.append((dist.isend(buf, dst), buf))

    def wait_sends(self) -> None:
        for work, _buf in self._pending:
            work.wait()  # type: ignore[attr-defined]
        self._pending.clear()

    def recv(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: str
    ) -> torch.Tensor:
        """-> [num_tokens, hidden_size] from the previous stage (blocking)."""
        src = self.shard.global_rank - self.shard.tp
        width = self._slice_width(hidden_size) if self.send_slices else hidden_size
        buf = torch.empty(num_tokens, width, dtype=dtype, device="cpu" if self.via_host else device)
        dist.recv(buf, src)
        buf = buf.to(device)
        return self.tp_group.all_gather(buf) if self.send_slices else buf


def choose_backend(requested: str, device: str) -> str:
    """auto: NCCL on CUDA, gloo on the CPU."""
    if requested == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    if requested == "nccl" and not device.startswith("cuda"):
        raise ValueError("comm_backend='nccl' needs device=cuda; use gloo on the CPU")
    return requested


def init_distributed(
    shard: ShardSpec, init_method: str, device: str, backend: str, timeout_s: float = 600.0
) -> TPGroup:
    """Joins the world of pp * tp ranks with `backend` and returns this worker's TP group."""
    world = shard.pp * shard.tp
    if world == 1:
        return TPGroup()
    logger.info(
        "joining %s world of %d as rank %d via %s", backend, world, shard.global_rank, init_method
    )
    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=world,
        rank=shard.global_rank,
        timeout=timedelta(seconds=timeout_s),
    )
    group = None
    # Every rank must create every group, in the same order.
    for stage in range(shard.pp):
        ranks = [stage * shard.tp + r for r in range(shard.tp)]
        g = dist.new_group(ranks) if shard.tp > 1 else None
        if stage == shard.stage:
            group = g
    return TPGroup(shard.tp, shard.tp_rank, group)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
