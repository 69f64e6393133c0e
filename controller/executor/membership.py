"""Who serves which place in the pipeline: (stage, tp_rank) for each worker that says hello."""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_proto import stage_pb2


@dataclass
class WorkerInfo:
    identity: bytes
    worker_id: str
    host: str
    stage: int
    tp_rank: int
    device: str = ""
    num_kv_blocks: int = 0
    param_bytes: int = 0
    ready: bool = False
    """Weights loaded and KV capacity reported (WorkerReady)."""
    cache_ready: bool = False
    """Its last heartbeat said its KV cache is allocated and zeroed (Heartbeat.cache_ready)."""
    last_seen_s: float = 0.0
    """Monotonic time of the last message from this worker (any kind)."""


class PipelineSlots:
    """The pp x tp places of one pipeline. A worker may ask for a place or take the next free one;
    two workers never get the same place, and a worker with the wrong model is refused."""

    def __init__(self, pp: int, tp: int, model: str) -> None:
        self.pp = pp
        self.tp = tp
        self.model = model
        self.workers: dict[tuple[int, int], WorkerInfo] = {}

    @property
    def full(self) -> bool:
        return len(self.workers) == self.pp * self.tp

    def claim(self, identity: bytes, hello: stage_pb2.WorkerHello) -> WorkerInfo:
        """Places the worker or raises ValueError with the reason (sent back as a Reject)."""
        if self.model and hello.model and hello.model != self.model:
            raise ValueError(f"worker serves model {hello.model!r}, the cluster {self.model!r}")
        if hello.stage >= 0 or hello.tp_rank >= 0:
            if not (0 <= hello.stage < self.pp and 0 <= hello.tp_rank < self.tp):
                raise ValueError(
                    f"asked for stage {hello.stage} rank {hello.tp_rank}; the cluster has "
                    f"pp={self.pp} stages of tp={self.tp} ranks"
                )
            place = (hello.stage, hello.tp_rank)
            taken = self.workers.get(place)
            if taken is not None:
                raise ValueError(
                    f"stage {place[0]} rank {place[1]} is already served by {taken.worker_id}"
                )
        else:
            free = [
                (s, r) for s in range(self.pp) for r in range(self.tp) if (s, r) not in self.workers
            ]
            if not free:
                raise ValueError(f"all {self.pp * self.tp} places of the pipeline are taken")
            place = free[0]
        info = WorkerInfo(
            identity, hello.worker_id, hello.host, place[0], place[1], device=hello.device
        )
        self.workers[place] = info
        return info

    def in_the_way(self, hello: stage_pb2.WorkerHello) -> list[WorkerInfo]:
        """The workers whose places keep hello's sender out: the holder of the place it asks
        for, or every worker when it asks for none and none is free."""
        if hello.stage >= 0 or hello.tp_rank >= 0:
            holder = self.workers.get((hello.stage, hello.tp_rank))
            return [] if holder is None else [holder]
        return list(self.workers.values()) if self.full else []

    def release(self, info: WorkerInfo) -> None:
        """Frees info's place (its worker is gone)."""
        if self.workers.get((info.stage, info.tp_rank)) is info:
            del self.workers[(info.stage, info.tp_rank)]

    def by_identity(self, identity: bytes) -> WorkerInfo | None:
        for info in self.workers.values():
            if info.identity == identity:
                return info
        return None

    def stage_hosts(self) -> dict[int, str]:
        return {s: w.host for (s, r), w in sorted(self.workers.items()) if r == 0}
