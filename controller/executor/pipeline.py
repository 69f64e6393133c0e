"""The real pipeline: stage workers reached over ZeroMQ, driven one micro-batch at a time.

Start-up follows stage.proto: every worker says hello and gets its place; once all have loaded
their weights and reported their KV capacity, each gets the cluster minimum and serving starts
(plans may be sent at once; the health waits until every worker's heartbeat says its cache is
zeroed: `preparing_cache`).
A plan goes to every worker of every stage at once; stages run plans in batch_id order, so the
controller never has to time anything per stage.

Failures: a worker unheard of for `heartbeat_timeout_s`, one the socket can no longer reach, a
step that raised on a worker (its StepFault), or a result that does not fit its plan (the
workers rejected the plan) takes the pipeline down; for the last two the engine hears which
micro-batch first, and quarantines its requests (controller/scheduler/quarantine.py).
Every other worker is told to exit (its supervisor restarts it), the engine requeues what was
in flight, and the same start-up runs again; when all places are filled and ready, serving
resumes with the same KV-cache size.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import zmq
from sarathi_proto import stage_pb2

from controller.config import ParallelConfig
from controller.executor.control_channel import ControlChannel
from controller.executor.membership import PipelineSlots, WorkerInfo
from controller.executor.plan_codec import decode_result, encode_plan_messages
from controller.logprobs import TokenLogprobs, decode_logprobs, decode_prompt_logprobs
from controller.scheduler import MicroBatch
from controller.step_log import StepLog
from controller.step_phases import ControllerPhases, clock
from controller.task_watch import start_watched
from controller.telemetry import StageTelemetry

log = logging.getLogger(__name__)

# (batch id, seq id -> sampled token, seq id -> its log-probabilities where asked, seq id ->
# prompt position -> log-probabilities where asked). Raises ValueError for a result that does
# not fit its plan.
ResultHandler = Callable[
    [int, dict[int, int], dict[int, TokenLogprobs], dict[int, dict[int, TokenLogprobs]]], None
]
# How often the watchdog looks at heartbeats and pings the workers.
_WATCH_PERIOD_S = 0.5


def _named(gone: Sequence[WorkerInfo]) -> str:
    return "; ".join(f"stage {w.stage} rank {w.tp_rank} ({w.worker_id}) is gone" for w in gone)


class PipelineExecutor:
    def __init__(
        self,
        channel: ControlChannel,
        parallel: ParallelConfig,
        model: str,
        dist_host: str,
        dist_port: int,
        socket_ifname: str = "",
        heartbeat_timeout_s: float = 5.0,
        new_dist_port: Callable[[], int] | None = None,
        step_log: StepLog | None = None,
    ) -> None:
        """dist_host empty: the torch.distributed rendezvous is stage 0 rank 0's host (its rank
        hosts the store), known once that worker has said hello. new_dist_port: a fresh
        rendezvous port for each rebuild (local mode); None keeps dist_port. step_log: where
        each micro-batch's composition and stage times go (--step-log)."""
        self.channel = channel
        self.parallel = parallel
        self.model = model
        self.slots = PipelineSlots(parallel.pp, parallel.tp, model)
        self.dist_host = dist_host
        self.dist_port = dist_port
        self.socket_ifname = socket_ifname
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.new_dist_port = new_dist_port
        self.stages = [StageTelemetry(stage=s) for s in range(parallel.pp)]
        self.phases = ControllerPhases()
        """The controller's step phases: this executor's, and the engine's (given the same)."""
        self.step_log = step_log
        self.started_at = time.monotonic()
        self.last_submitted_batch_id = 0
        self.up = False
        """True while every worker is present and serving."""
        self.down_reason = "the pipeline is starting"
        self.down_since_s = time.monotonic()
        self.start_since_s = self.down_since_s
        """When the current start-up began: the pipeline went down, or its rebuild started
        over (liveness gives each start-up --worker-start-timeout)."""
        self.down_stages: tuple[int, ...] = ()
        """The stages whose workers were lost when the pipeline last went down."""
        self.num_rebuilds = 0
        self.num_kv_blocks = 0
        self.block_size = 0
        self.on_down: Callable[[str], None] = lambda reason: None
        self.on_up: Callable[[], None] = lambda: None
        self.on_refused: Callable[[str], None] = lambda reason: None
        self.on_step_fault: Callable[[int, str], None] = lambda batch_id, reason: None
        """Called with a micro-batch's id and why, when its step failed on a worker or the
        workers rejected its plan, before the pipeline goes down (the engine quarantines its
        requests: controller/scheduler/quarantine.py)."""
        self.on_task_failed: Callable[[str], None] = lambda name: None
        """Called with the name of this executor's task that raised (task_watch.py logs it):
        without its receive loop or watchdog the pipeline can never be served again."""
        """Called with the reason whenever a worker is refused (wrong model, place taken)."""
        self.last_refusal = ""
        self.last_refused: tuple[str, str] = ("", "")
        """(worker_id, host) of the last worker refused: the events find its pod with them."""
        self._on_result: ResultHandler | None = None
        self._assigned = False
        """Every place was filled and assigned since the pipeline last went down."""
        self._all_ready = asyncio.Event()
        self._places = asyncio.Lock()
        """Held while the places change on a hello, a ready or the watch's look at them while
        the pipeline is down: each awaits sends, and must not act on what another changed."""
        self._tasks: list[asyncio.Task[None]] = []

    # ---- start-up -------------------------------------------------------------------------
    async def start(self, timeout_s: float) -> int:
        """Waits for every worker to register and load; returns the KV blocks every worker uses."""
        if not self._tasks:
            self._tasks.append(
                start_watched(self._receive_loop(), "pipeline-recv", self._task_failed)
            )
            self._tasks.append(start_watched(self._watch(), "pipeline-watchdog", self._task_failed))
        try:
            await asyncio.wait_for(self._all_ready.wait(), timeout_s)
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
        return min(w.num_kv_blocks for w in self.slots.workers.values())

    async def _on_hello(self, identity: bytes, hello: stage_pb2.WorkerHello) -> None:
        async with self._places:
            await self._place(identity, hello)

    async def _place(self, identity: bytes, hello: stage_pb2.WorkerHello) -> None:
        await self._make_way(hello)
        try:
            info = self.slots.claim(identity, hello)
        except ValueError as err:
            self.last_refusal = f"refused worker {hello.worker_id} from {hello.host}: {err}"
            self.last_refused = (hello.worker_id, hello.host)
            log.error("%s", self.last_refusal)
            self.on_refused(self.last_refusal)
            reject = stage_pb2.ControllerMessage(reject=stage_pb2.Reject(reason=str(err)))
            await self._send_quietly(identity, reject)
            return
        info.last_seen_s = time.monotonic()
        stage = self.stages[info.stage]
        stage.tp_ranks.add(info.tp_rank)
        if info.tp_rank == 0:
            stage.host, stage.device = info.host, info.device
        log.info(
            "worker %s on %s -> stage %d rank %d",
            info.worker_id,
            info.host,
            info.stage,
            info.tp_rank,
        )
        if self.slots.full and not await self._release_gone():
            # Everyone is present: now the rendezvous (hosted by rank 0) is known to all.
            self._assigned = True
            for worker in self.slots.workers.values():
                await self._assign(worker)

    async def _release_gone(self) -> bool:
        """Before the places are assigned: frees those whose worker's socket is gone (killed
        after its hello, its successor in another place), so that none joins torch.distributed
        with a dead rank. True when one was freed (the pipeline waits for another hello)."""
        gone = await self._gone(self.slots.workers.values())
        if gone:
            await self._let_go(gone, f"{_named(gone)} as the places fill")
        return bool(gone)

    async def _make_way(self, hello: stage_pb2.WorkerHello) -> None:
        """Before a worker is refused a place that is taken: a holder whose socket is gone (a
        worker killed while the pipeline was being rebuilt, or before its loss was noticed, whose
        successor is saying hello) gives the place up (_let_go)."""
        if self._all_ready.is_set() and not self.up:
            return  # every worker was ready a moment ago: serving starts, and its watch decides
        gone = await self._gone(self.slots.in_the_way(hello))
        if gone:
            await self._let_go(gone, f"{_named(gone)}, and {hello.worker_id} asks for a place")

    async def _let_go(self, gone: list[WorkerInfo], reason: str) -> None:
        """Workers whose sockets are gone give up their places. Up, that is a lost stage, as
        any. Down, the places are freed; once they were assigned, the others may be joining
        torch.distributed with a dead one, so the start-up starts over."""
        stages = [info.stage for info in gone]
        if self.up:
            await self.fail(reason, stages)
        elif self._assigned:
            log.warning("the start-up starts over: %s", reason)
            self._down_for(reason, stages)
            await self._start_over()
        else:
            log.warning("freeing places: %s", reason)
            for info in gone:
                self.slots.release(info)

    async def _gone(self, workers: Iterable[WorkerInfo]) -> list[WorkerInfo]:
        """Those of workers whose sockets are gone (each is sent a ping)."""
        return [info for info in list(workers) if not await self._reachable(info)]

    async def _reachable(self, info: WorkerInfo) -> bool:
        """False when the worker's socket is gone (ROUTER_MANDATORY refuses the send: host
        unreachable); a full queue to a busy worker (EAGAIN, or a send that waits) is there."""
        try:
            await asyncio.wait_for(self.channel.send_bytes(info.identity, self._ping()), 1.0)
        except zmq.ZMQError as err:
            return err.errno != zmq.EHOSTUNREACH
        except TimeoutError:
            pass
        return True

    async def _assign(self, info: WorkerInfo) -> None:
        dist_host = self.dist_host or self.slots.workers[(0, 0)].host
        assignment = stage_pb2.WorkerAssignment(
            stage=info.stage,
            tp_rank=info.tp_rank,
            pp=self.parallel.pp,
            tp=self.parallel.tp,
            dist_init_method=f"tcp://{dist_host}:{self.dist_port}",
            socket_ifname=self.socket_ifname,
            layer_split=self.parallel.layer_split,
        )
        await self._send_quietly(info.identity, stage_pb2.ControllerMessage(assignment=assignment))

    async def _on_ready(self, identity: bytes, ready: stage_pb2.WorkerReady) -> None:
        async with self._places:
            await self._mark_ready(identity, ready)

    async def _mark_ready(self, identity: bytes, ready: stage_pb2.WorkerReady) -> None:
        info = self.slots.by_identity(identity)
        if info is None:
            log.warning("ready from an unknown worker; ignored")
            return
        info.ready = True
        info.num_kv_blocks = ready.num_kv_blocks
        info.param_bytes = ready.param_bytes
        log.info(
            "worker %s (stage %d rank %d on %s) ready: %d KV blocks, %.1f MB of weights",
            info.worker_id, info.stage, info.tp_rank, info.host,
            info.num_kv_blocks, info.param_bytes / 1e6,
        )  # fmt: skip
        if not (self.slots.full and all(w.ready for w in self.slots.workers.values())):
            return
        self._all_ready.set()
        if self._on_result is not None:  # a rebuild, not the first start-up
            await self._resume()

    async def begin_serving(
        self, num_kv_blocks: int, block_size: int, on_result: ResultHandler
    ) -> None:
        """Tells every worker to allocate its cache, then starts delivering results."""
        self._on_result = on_result
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        await self._send_cache()
        self.started_at = time.monotonic()
        self.up, self.down_reason, self.last_refusal = True, "", ""

    def _task_failed(self, name: str) -> None:
        self.on_task_failed(name)  # looked up now: set after the tasks started

    async def _send_cache(self) -> None:
        cache = stage_pb2.ControllerMessage(
            cache=stage_pb2.CacheAssignment(
                num_kv_blocks=self.num_kv_blocks, block_size=self.block_size
            )
        )
        for info in self.slots.workers.values():
            await self._send_quietly(info.identity, cache)

    # ---- failure and rebuild --------------------------------------------------------------
    async def fail(self, reason: str, stages: Sequence[int] = ()) -> None:
        """Takes the pipeline down: every worker is told to exit and a new start-up begins.
        stages: those whose workers were lost (for the events on their pods)."""
        if not self.up:
            return
        log.error("pipeline down: %s; rebuilding", reason)
        self.up, self.down_since_s = False, time.monotonic()
        self._down_for(reason, stages)
        self.on_down(reason)
        await self._start_over()

    def _down_for(self, reason: str, stages: Sequence[int]) -> None:
        self.down_reason, self.down_stages = reason, tuple(sorted(set(stages)))

    async def _start_over(self) -> None:
        """Every place freed and every worker told to exit, for a new start-up."""
        self.start_since_s = time.monotonic()
        old = list(self.slots.workers.values())
        self.slots = PipelineSlots(self.parallel.pp, self.parallel.tp, self.model)
        self._assigned = False
        self._all_ready.clear()
        self.phases.forget_in_flight()
        if self.step_log is not None:
            self.step_log.forget_in_flight()
        for stage in self.stages:
            stage.tp_ranks.clear()
            stage.last_batch_id = self.last_submitted_batch_id  # lost batches are not in flight
        if self.new_dist_port is not None:
            self.dist_port = self.new_dist_port()
        bye = stage_pb2.ControllerMessage(shutdown=True)
        for info in old:
            await self._send_quietly(info.identity, bye)

    async def _resume(self) -> None:
        smallest = min(w.num_kv_blocks for w in self.slots.workers.values())
        if smallest < self.num_kv_blocks:
            log.warning(
                "rebuilt workers report %d KV blocks, fewer than the %d in use; keeping %d",
                smallest, self.num_kv_blocks, self.num_kv_blocks,
            )  # fmt: skip
        await self._send_cache()
        self.num_rebuilds += 1
        log.info(
            "pipeline rebuilt (#%d) after %.2f s down; serving again",
            self.num_rebuilds,
            time.monotonic() - self.down_since_s,
        )
        self.up, self.down_reason, self.last_refusal = True, "", ""
        self.on_up()

    def _ping(self) -> bytes:
        """Liveness, with each stage's last finished micro-batch: a worker waiting on a
        neighbour waits on while the neighbour is still stepping what comes first."""
        progress = stage_pb2.Ping(last_batch_ids=[stage.last_batch_id for stage in self.stages])
        return stage_pb2.ControllerMessage(ping=progress).SerializeToString()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_PERIOD_S)
            if not self.up:
                await self._ping_while_down()
                continue
            lost, lost_stages = self._silent_workers(time.monotonic())
            if not lost:  # a ping says every worker is heard from
                ping = self._ping()
                for info in list(self.slots.workers.values()):
                    try:
                        await self.channel.send_bytes(info.identity, ping)
                    except zmq.ZMQError as err:
                        lost.append(f"stage {info.stage} rank {info.tp_rank} unreachable: {err}")
                        lost_stages.append(info.stage)
            if lost:
                await self.fail("; ".join(lost), lost_stages)

    async def _ping_while_down(self) -> None:
        """While the pipeline starts (or is rebuilt): a ping to every worker holding a place
        says the controller is there (a worker waiting for its assignment or its cache leaves
        after --controller-timeout of silence, to find a restarted controller), and finds those
        gone meanwhile without waiting for a successor's hello."""
        async with self._places:  # what it finds holds until it has acted on it
            if self.up or self._all_ready.is_set():
                return  # serving (starts now): the watch looks once it has
            gone = await self._gone(self.slots.workers.values())
            if gone:
                await self._let_go(gone, f"{_named(gone)} while the pipeline was starting")

    def _silent_workers(self, now: float) -> tuple[list[str], list[int]]:
        """Every worker not heard from within the heartbeat timeout, named, and its stage."""
        lost, lost_stages = [], []
        for info in self.slots.workers.values():
            silent_s = now - info.last_seen_s
            if silent_s > self.heartbeat_timeout_s:
                lost.append(
                    f"stage {info.stage} rank {info.tp_rank} ({info.worker_id}) sent no "
                    f"heartbeat for {silent_s:.1f} s"
                )
                lost_stages.append(info.stage)
        return lost, lost_stages

    # ---- serving --------------------------------------------------------------------------
    async def submit(self, batch: MicroBatch) -> None:
        """Sends one micro-batch to every worker; only stage 0 gets the token ids. While the
        pipeline is down the batch is dropped: the engine requeued its sequences."""
        if not self.up:
            return
        phases = self.phases
        encoding = clock()
        first_bytes, rest_bytes = encode_plan_messages(batch)
        sending = clock()
        phases.encode_s += sending - encoding
        self.last_submitted_batch_id = batch.batch_id
        # Every worker is tried before the pipeline is declared down: when one dies its
        # neighbours' links break and they exit too, and status must name every stage that is
        # gone, not only the first one in send order.
        unreachable, lost_stages = [], []
        for (stage, rank), info in list(self.slots.workers.items()):
            try:
                await self.channel.send_bytes(
                    info.identity, first_bytes if stage == 0 else rest_bytes
                )
            except zmq.ZMQError as err:  # the worker's socket is gone: it died
                unreachable.append(f"stage {stage} rank {rank} unreachable: {err}")
                lost_stages.append(stage)
        sent = clock()
        phases.send_s += sent - sending
        phases.sent(batch.batch_id, sent)
        if self.step_log is not None:
            self.step_log.sent(batch, sent)
        if unreachable:
            await self.fail("; ".join(unreachable), lost_stages)

    async def _receive_loop(self) -> None:
        while True:
            identity, msg = await self.channel.recv()
            info = self.slots.by_identity(identity)
            if info is not None:
                info.last_seen_s = time.monotonic()
            kind = msg.WhichOneof("body")
            if kind == "result":
                # Results of workers from before a rebuild belong to batches already requeued.
                if self.up and info is not None and self._on_result is not None:
                    await self._deliver_or_rebuild(msg.result, self._on_result)
            elif kind == "heartbeat":
                if info is not None:
                    self._on_heartbeat(info, msg.heartbeat)
                self.phases.receive_s += clock() - self.channel.received_at
            elif kind == "hello":
                await self._on_hello(identity, msg.hello)  # a Reject when every place is taken
            elif kind == "ready":
                await self._on_ready(identity, msg.ready)
            elif kind == "alive":
                pass  # a worker mid-step: being heard from (last_seen_s above) is the message
            elif kind == "fault":
                await self._on_fault(msg.fault, current=info is not None)
            else:
                log.warning("unexpected %s from %s", kind, info and info.worker_id)

    async def _on_fault(self, fault: stage_pb2.StepFault, current: bool) -> None:
        """A worker's step raised, and the worker exits: the engine hears which micro-batch
        (also from a worker of a pipeline already down: the requeue may have come first), and
        a current worker's pipeline is rebuilt without waiting for its silence."""
        reason = (
            f"stage {fault.stage} rank {fault.tp_rank} failed micro-batch {fault.batch_id}: "
            f"{fault.error}"
        )
        self.on_step_fault(fault.batch_id, reason)
        if current:
            await self.fail(reason, [fault.stage])

    async def _deliver_or_rebuild(
        self, result: stage_pb2.StepResult, on_result: ResultHandler
    ) -> None:
        """Delivers a result; one that does not fit its plan takes the pipeline down and
        rebuilds it. A stage that rejects a plan (PlanError) says so (`rejected`) and keeps its
        state as it was, so the plans after it are rejected too: only new workers, and the
        engine's requests requeued for recompute, serve again."""
        if result.rejected:
            reason = (
                f"the workers rejected the plan of micro-batch {result.batch_id} (the "
                "refusing stages' logs say why)"
            )
            self.on_step_fault(result.batch_id, reason)
            await self.fail(reason)
            return
        try:
            self._deliver(result, on_result)
        except ValueError as err:  # ResultHandler's contract
            # Not something a worker sends: a bug on one side or the other, so the traceback.
            reason = f"the result of micro-batch {result.batch_id} does not fit its plan: {err}"
            log.error("%s", reason, exc_info=err)
            await self.fail(reason)

    def _deliver(self, result: stage_pb2.StepResult, on_result: ResultHandler) -> None:
        """Decodes a result and hands it to the engine (which times its own apply)."""
        phases, arrived = self.phases, self.channel.received_at
        decoding = clock()
        phases.receive_s += decoding - arrived
        sampled = decode_result(result)
        logprobs = decode_logprobs(result) if result.logprob_rows else {}
        prompt = decode_prompt_logprobs(result) if result.prompt_logprobs else {}
        phases.decode_s += clock() - decoding
        phases.returned(result.batch_id, arrived)
        if self.step_log is not None:
            self.step_log.returned(result.batch_id, arrived)
        on_result(result.batch_id, sampled, logprobs, prompt)

    def _on_heartbeat(self, info: WorkerInfo, hb: stage_pb2.Heartbeat) -> None:
        info.cache_ready = hb.cache_ready  # every rank: each zeroes a cache of its own
        if hb.tp_rank != 0 or hb.stage >= len(self.stages):
            return
        stage = self.stages[hb.stage]
        stage.on_heartbeat(time.monotonic(), hb.last_batch_id, hb.step_busy_s, hb.busy_s_total)
        if hb.HasField("phases"):
            stage.phases = hb.phases
            if self.step_log is not None:
                p = hb.phases
                self.step_log.stage_reported(
                    hb.stage, hb.last_batch_id, p.step_s, p.prepare_s, p.recv_wait_s
                )

    def preparing_cache(self) -> list[WorkerInfo]:
        """While the pipeline is up, its workers, in stage and rank order, that have not yet
        reported their KV cache zeroed: no step runs until they have, so the controller is not
        serving (health_watch.py) and status marks their stages."""
        if not self.up:
            return []
        return [w for _, w in sorted(self.slots.workers.items()) if not w.cache_ready]

    def inflight_on_stage(self, stage: int) -> int:
        return max(0, self.last_submitted_batch_id - self.stages[stage].last_batch_id)

    def heartbeat_age_s(self, stage: int, now: float) -> float:
        """Seconds since the stage's quietest worker was last heard from."""
        seen = [w.last_seen_s for (s, _), w in self.slots.workers.items() if s == stage]
        return now - min(seen) if seen else now - self.down_since_s

    def lagging_stage(self) -> int | None:
        """The first stage that has not finished the last submitted micro-batch: stages run in
        order, so it holds the oldest unfinished one."""
        for stage in range(self.parallel.pp):
            if self.inflight_on_stage(stage) > 0:
                return stage
        return None

    async def _send_quietly(self, identity: bytes, msg: stage_pb2.ControllerMessage) -> None:
        try:
            await asyncio.wait_for(self.channel.send(identity, msg), 1.0)
        except (zmq.ZMQError, TimeoutError) as err:  # a worker that is already gone
            log.debug("send to a worker failed: %s", err)

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        bye = stage_pb2.ControllerMessage(shutdown=True)
        for info in list(self.slots.workers.values()):
            await self._send_quietly(info.identity, bye)

    @property
    def workers(self) -> list[WorkerInfo]:
        return list(self.slots.workers.values())

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The receive loop and the watchdog."""
        return list(self._tasks)
