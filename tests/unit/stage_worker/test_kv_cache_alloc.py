"""The KV cache is zeroed a chunk at a time with a progress call after each, so a worker whose
large cache takes seconds to zero keeps heartbeating (it was taken for dead and restarted in a
loop with `--kv-cache-mb 8192` on a 2-core VM), and those heartbeats say the cache is not ready
yet (the controller called itself serving while they went on)."""

from __future__ import annotations

import pytest
import torch
import zmq
from sarathi_proto import stage_pb2

from stage_worker import kv_cache
from stage_worker import worker as worker_module
from stage_worker.config import ShardSpec
from stage_worker.kv_cache import KVCache
from stage_worker.worker import StageWorker, WorkerConfig


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


def test_heartbeats_say_not_ready_while_zeroing_and_ready_from_then_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_cache, "ZERO_CHUNK_BYTES", 1024)  # 4 chunks below
    monkeypatch.setattr(worker_module, "IDLE_HEARTBEAT_S", 0.0)  # a heartbeat after each chunk
    address = "inproc://cache-ready-heartbeats"
    controller = zmq.Context.instance().socket(zmq.ROUTER)  # the worker's context: inproc
    controller.bind(address)
    worker = StageWorker(WorkerConfig(controller=address, model_dir="unused"))
    try:
        worker.shard = ShardSpec(pp=2, tp=1, stage=1, tp_rank=0)
        assigned = stage_pb2.CacheAssignment(num_kv_blocks=7, block_size=4)
        worker._allocate_cache(assigned, 2, 2, 8, torch.bfloat16)  # 4096 bytes
        worker._heartbeat(0.0)  # a later one: idle, an answer to a ping, or after a step
        beats = []
        while controller.poll(200):
            _identity, payload = controller.recv_multipart()
            beats.append(stage_pb2.WorkerMessage.FromString(payload).heartbeat)
    finally:
        worker._control.close()
        controller.close(linger=0)
    assert [b.cache_ready for b in beats] == [False] * 4 + [True, True]
    assert all((b.stage, b.tp_rank) == (1, 0) for b in beats)
