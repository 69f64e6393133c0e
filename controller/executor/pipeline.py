"""The real pipeline: stage workers reached over ZeroMQ, driven one micro-batch at a time.

Start-up follows stage.proto: every worker says hello and gets its place; once all have loaded
their weights and reported their KV capacity, each gets the cluster minimum and serving starts.
A plan goes to every worker of every stage at once; stages run plans in batch_id order, so the
controller never has to time anything per stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sarathi_proto import stage_pb2

from controller.config import ParallelConfig
from controller.executor.control_channel import ControlChannel
from controller.executor.membership import PipelineSlots, WorkerInfo
from controller.executor.plan_codec import decode_result, encode_plan
from controller.scheduler import MicroBatch
from controller.telemetry import StageTelemetry

log = logging.getLogger(__name__)

ResultHandler = Callable[[int, dict[int, int]], None]


class PipelineExecutor:
    def __init__(
        self,
        channel: ControlChannel,
        parallel: ParallelConfig,
        model: str,
        dist_host: str,
        dist_port: int,
        socket_ifname: str = "",
    ) -> None:
        """dist_host empty: the torch.distributed rendezvous is stage 0 rank 0's host (its rank
        hosts the store), known once that worker has said hello."""
        self.channel = channel
        self.parallel = parallel
        self.slots = PipelineSlots(parallel.pp, parallel.tp, model)
        self.dist_host = dist_host
        self.dist_port = dist_port
        self.socket_ifname = socket_ifname
        self.stages = [StageTelemetry(stage=s) for s in range(parallel.pp)]
        self.started_at = time.monotonic()
        self.last_submitted_batch_id = 0
        self._on_result: ResultHandler | None = None
        self._receiver: asyncio.Task[None] | None = None

    # ---- start-up -------------------------------------------------------------------------
    async def start(self, timeout_s: float) -> int:
        """Waits for every worker to register and load; returns the KV blocks every worker uses."""
        try:
            return await asyncio.wait_for(self._handshake(), timeout_s)
        except TimeoutError:
            missing = [
                (s, r)
                for s in range(self.parallel.pp)
                for r in range(self.parallel.tp)
                if (s, r) not in self.slots.workers or not self.slots.workers[(s, r)].ready
            ]
            raise TimeoutError(
                f"workers for (stage, rank) {missing} did not become ready within {timeout_s} s"
            ) from None

    async def _handshake(self) -> int:
        while True:
            identity, msg = await self.channel.recv()
            kind = msg.WhichOneof("body")
            if kind == "hello":
                await self._on_hello(identity, msg.hello)
            elif kind == "ready":
                info = self.slots.by_identity(identity)
                if info is None:
                    log.warning("ready from an unknown worker; ignored")
                    continue
                info.ready = True
                info.num_kv_blocks = msg.ready.num_kv_blocks
                info.param_bytes = msg.ready.param_bytes
                log.info(
                    "worker %s (stage %d rank %d on %s) ready: %d KV blocks, %.1f MB of weights",
                    info.worker_id, info.stage, info.tp_rank, info.host,
                    info.num_kv_blocks, info.param_bytes / 1e6,
                )  # fmt: skip
                if self.slots.full and all(w.ready for w in self.slots.workers.values()):
                    return min(w.num_kv_blocks for w in self.slots.workers.values())
            else:
                log.debug("ignoring %s before start-up finished", kind)

    async def _on_hello(self, identity: bytes, hello: stage_pb2.WorkerHello) -> None:
        try:
            info = self.slots.claim(identity, hello)
        except ValueError as err:
            log.error("refusing worker %s from %s: %s", hello.worker_id, hello.host, err)
            reject = stage_pb2.ControllerMessage(reject=stage_pb2.Reject(reason=str(err)))
            await self.channel.send(identity, reject)
            return
        stage = self.stages[info.stage]
        stage.tp_ranks.add(info.tp_rank)
        if info.tp_rank == 0:
            stage.host = info.host
        log.info(
            "worker %s on %s -> stage %d rank %d",
            info.worker_id,
            info.host,
            info.stage,
            info.tp_rank,
        )
        if self.slots.full:
            # Everyone is present: now the rendezvous (hosted by rank 0) is known to all.
            for worker in self.slots.workers.values():
                await self._assign(worker)

    async def _assign(self, info: WorkerInfo) -> None:
        dist_host = self.dist_host or self.slots.workers[(0, 0)].host
        assignment = stage_pb2.WorkerAssignment(
            stage=info.stage,
            tp_rank=info.tp_rank,
            pp=self.parallel.pp,
            tp=self.parallel.tp,
            dist_init_method=f"tcp://{dist_host}:{self.dist_port}",
            socket_ifname=self.socket_ifname,
        )
        await self.channel.send(info.identity, stage_pb2.ControllerMessage(assignment=assignment))

    async def begin_serving(
        self, num_kv_blocks: int, block_size: int, on_result: ResultHandler
    ) -> None:
        """Tells every worker to allocate its cache, then starts delivering results."""
        self._on_result = on_result
        cache = stage_pb2.ControllerMessage(
            cache=stage_pb2.CacheAssignment(num_kv_blocks=num_kv_blocks, block_size=block_size)
        )
        for info in self.slots.workers.values():
            await self.channel.send(info.identity, cache)
        self.started_at = time.monotonic()
        self._receiver = asyncio.create_task(self._receive_loop(), name="pipeline-receiver")

    # ---- serving --------------------------------------------------------------------------
    async def submit(self, batch: MicroBatch) -> None:
        """Sends one micro-batch to every worker; only stage 0 gets the token ids."""
        first = stage_pb2.ControllerMessage(plan=encode_plan(batch, with_token_ids=True))
        rest = stage_pb2.ControllerMessage(plan=encode_plan(batch, with_token_ids=False))
        first_bytes, rest_bytes = first.SerializeToString(), rest.SerializeToString()
        for (stage, _), info in self.slots.workers.items():
            await self.channel.send_bytes(info.identity, first_bytes if stage == 0 else rest_bytes)
        self.last_submitted_batch_id = batch.batch_id

    async def _receive_loop(self) -> None:
        while True:
            identity, msg = await self.channel.recv()
            kind = msg.WhichOneof("body")
            if kind == "result":
                assert self._on_result is not None
                self._on_result(msg.result.batch_id, decode_result(msg.result))
            elif kind == "heartbeat":
                self._on_heartbeat(msg.heartbeat)
            elif kind == "hello":
                await self._on_hello(identity, msg.hello)  # every place is taken: a Reject
            else:
                info = self.slots.by_identity(identity)
                log.warning("unexpected %s from %s while serving", kind, info and info.worker_id)

    def _on_heartbeat(self, hb: stage_pb2.Heartbeat) -> None:
        if hb.tp_rank != 0 or hb.stage >= len(self.stages):
            return
        self.stages[hb.stage].on_heartbeat(
            time.monotonic(), hb.last_batch_id, hb.step_busy_s, hb.busy_s_total
        )

    def inflight_on_stage(self, stage: int) -> int:
        return max(0, self.last_submitted_batch_id - self.stages[stage].last_batch_id)

    async def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        bye = stage_pb2.ControllerMessage(shutdown=True)
        for info in list(self.slots.workers.values()):
            try:
                await asyncio.wait_for(self.channel.send(info.identity, bye), 1.0)
            except Exception as err:  # a worker that is already gone
                log.debug("shutdown to %s failed: %s", info.worker_id, err)

    @property
    def workers(self) -> list[WorkerInfo]:
        return list(self.slots.workers.values())
