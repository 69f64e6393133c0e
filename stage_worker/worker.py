"""The stage worker process: start-up handshake with the controller, then one step per StepPlan.

Start-up: hello -> assignment -> load this stage's weight slices, join torch.distributed ->
ready(num_kv_blocks, param_bytes) -> cache(num_kv_blocks, block_size) -> zero the cache ->
heartbeat(cache_ready) -> serve plans until shutdown. Every frame on the socket is one
serialized WorkerMessage / ControllerMessage.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn

import torch
import zmq
import zmq.auth  # CurveZMQ certificate files (text, no pickle)
from sarathi_proto import stage_pb2

from stage_worker import bf16_layouts
from stage_worker.attention import make_backend
from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import (
    PipelineLinks,
    TPGroup,
    choose_backend,
    destroy_distributed,
    init_distributed,
)
from stage_worker.config import ShardSpec, load_spec
from stage_worker.control_socket import ControlSocket, PeerWait
from stage_worker.cuda_graphs import DecodeGraphs
from stage_worker.errors import PlanError, StepFaulted
from stage_worker.kv_cache import GPU_CACHE_FRACTION, KVCache, bytes_per_block, num_blocks_that_fit
from stage_worker.layers import cpu_matmul, fused, gemv
from stage_worker.models import DTYPES, StageModel, build_stage, llama_cpu_loop
from stage_worker.runner import PreparedStep, StageRunner, prompt_logprobs
from stage_worker.sampler import TokenLogprobs
from stage_worker.step_timer import StepTimer, TimedAttention
from stage_worker.watchdog import Watchdog

logger = logging.getLogger(__name__)

# How often an idle worker tells the controller it is alive (a stepping one: control_socket.py).
IDLE_HEARTBEAT_S = 1.0


class _LogTag(logging.Filter):
    """Puts the worker's place (stage and TP rank, once assigned) into every log record."""

    tag = "s?r?"

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.tag
        return True


_LOG_TAG = _LogTag()


def install_log_tag() -> None:
    for handler in logging.getLogger().handlers:
        handler.addFilter(_LOG_TAG)


@dataclass(frozen=True)
class WorkerConfig:
    controller: str
    """ZeroMQ address of the controller's ROUTER, e.g. tcp://10.0.0.1:5555."""
    model_dir: str
    advertise_host: str = ""
    """Address other nodes reach this worker at; empty: this host's address on the route to the
    controller (hosts the torch.distributed rendezvous when this worker is stage 0 rank 0)."""
    stage: int = -1
    """Requested stage; -1 lets the controller assign it."""
    tp_rank: int = -1
    device: str = "cpu"
    dtype: str = "bfloat16"
    kv_cache_bytes: int = 1 << 30
    """CPU only: memory for the KV cache (on CUDA the free memory after loading decides)."""
    workers_on_host: int = 1
    """Workers loading on this machine at once (`up --local` starts them all together): each
    judges its share of the memory when it chooses its bf16 weights' layouts."""
    block_size_hint: int = 16
    """Tokens per block assumed when reporting num_kv_blocks (the controller confirms it)."""
    num_threads: int = 0
    """torch intra-op threads; 0 keeps torch's default."""
    attention: str = "torch"
    send_slices: bool = False
    """Each TP rank sends only its 1/tp of the activations; the next stage all-gathers."""
    small_batch_kernel: bool = False
    """CPU bf16, one thread: steps of up to 2 tokens run a streaming GEMV kernel (decode of one
    token about 1.6x faster) at the cost of a second copy of the linear weights."""
    fused_ops: bool = True
    """Norms, rotary and SiLU-times-up run as fused kernels where they can (layers/fused.py)."""
    cpu_matmul_kernel: bool = True
    """CPU float32: linear layers run the package's AVX2 matmul kernel where it can
    (layers/cpu_matmul.py); off, MKL's or oneDNN's through torch."""
    cpu_layer_loop: bool = True
    """CPU float32, Llama family, TP=1: the layers run as one loop over the C kernels
    (models/llama_cpu_loop.py); off, as a module call per layer part."""
    cuda_graphs: bool = True
    """On CUDA with TP=1: decode steps replay CUDA graphs captured per batch bucket (no effect
    on the CPU). On an H200 they take a 7B decode step of one sequence from 13-16 ms to 5.4-6
    (BENCHMARKS.md, GPU section)."""
    comm_backend: str = "auto"
    """torch.distributed backend: auto (NCCL on CUDA, gloo on the CPU), nccl or gloo (on CUDA:
    for several workers on one GPU; activations cross through host memory)."""
    gpu_cache_fraction: float = GPU_CACHE_FRACTION
    """CUDA: share of the free GPU memory after loading that the KV cache may take."""
    curve_server_key_file: str = ""
    """The controller's public ZeroMQ certificate: connect with CurveZMQ (with curve_key_file)."""
    curve_key_file: str = ""
    """This worker's ZeroMQ certificate with its secret key."""
    controller_timeout_s: float = 10.0
    """While serving, a controller unheard of for this long is gone: exit, to be restarted
    and to register with its successor (the controller pings every half second). Also how long
    a wait on a neighbouring stage may outlast the last ping saying it is still stepping."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {', '.join(DTYPES)}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r}: must be cpu or cuda")
        if self.kv_cache_bytes < 0:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes}: must be >= 0")
        if self.workers_on_host < 1:
            raise ValueError(f"workers_on_host={self.workers_on_host}: must be >= 1")
        if self.attention not in ("torch", "flashinfer"):
            raise ValueError(f"attention={self.attention!r}: must be torch or flashinfer")
        if bool(self.curve_server_key_file) != bool(self.curve_key_file):
            raise ValueError("curve_key_file: set together with curve_server_key_file")
        if not 1.0 <= self.controller_timeout_s <= 3600.0:
            raise ValueError(
                f"controller_timeout_s={self.controller_timeout_s}: must be in [1, 3600]"
            )
        if self.block_size_hint < 1:
            raise ValueError(f"block_size_hint={self.block_size_hint}: must be >= 1")
        if self.comm_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"comm_backend={self.comm_backend!r}: must be auto, nccl or gloo")
        choose_backend(self.comm_backend, self.device)  # nccl on the CPU is refused here
        if not 0.0 < self.gpu_cache_fraction <= 1.0:
            raise ValueError(f"gpu_cache_fraction={self.gpu_cache_fraction}: must be in (0, 1]")


class WorkerRejected(RuntimeError):
    """The controller refused this worker (its place is taken, or its model differs)."""


class ControllerLost(ConnectionError):
    """No message from the controller within controller_timeout_s while serving."""


class ControllerChanged(Exception):
    """Cluster mode: another controller took over; leave the pipeline and join its."""


# Exit status of a worker whose pipeline broke (a peer died): its supervisor restarts it.
EXIT_PIPELINE_BROKEN = 3
# A step fault's report: how long the exiting worker waits for it to leave, and how much of the
# exception's text it carries (the worker's log has the traceback).
_FAULT_LINGER_S = 2.0
_MAX_FAULT_TEXT = 2000


def route_address(zmq_addr: str) -> str:
    """This host's IP on the route to a tcp:// address (no packet is sent: UDP connect only)."""
    host = zmq_addr.removeprefix("tcp://").rsplit(":", 1)[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            address: str = probe.getsockname()[0]
            return address
    except OSError:
        return socket.gethostname()


class StageWorker:
    def __init__(
        self, config: WorkerConfig, next_controller: Callable[[float], str] | None = None
    ) -> None:
        """next_controller(timeout_s): cluster mode, the control address of the controller that
        took over (etcd_registration.py); with it, a worker told `controller_changed` joins the
        new controller in this process, keeping its weights, instead of exiting."""
        self.config = config
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._ctx: zmq.Context = zmq.Context.instance()
        self._next_controller = next_controller
        self._changed = threading.Event()
        self._controller_addr = config.controller
        self._control = ControlSocket(self._connect(config.controller))
        self._model: StageModel | None = None
        """The loaded stage, kept across controllers (TP=1: nothing in it names a group)."""
        self._start_s = time.monotonic()
        self._busy_s_total = 0.0
        self._last_batch_id = 0
        self._timer: StepTimer | None = None
        self._cache_ready = False
        """This pipeline's KV cache is allocated and zeroed (Heartbeat.cache_ready)."""
        self._refused_plan = False
        """This stage refused a plan of this pipeline: it runs no later one."""
        self.shard: ShardSpec | None = None
        # A peer behind a cut link never answers: no wait on one may outlast the time after
        # which the controller would count this worker gone anyway, unless the controller says
        # the peer is still stepping what comes first (_waiting_on).
        self._watchdog = Watchdog(EXIT_PIPELINE_BROKEN)
        self._peer_wait_s = config.controller_timeout_s

    # ---- socket ----------------------------------------------------------------------------
    def _connect(self, addr: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        cfg = self.config
        if cfg.curve_server_key_file:
            server_public, _ = zmq.auth.load_certificate(cfg.curve_server_key_file)
            public, secret = zmq.auth.load_certificate(cfg.curve_key_file)
            sock.curve_serverkey = server_public
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        sock.connect(addr)
        return sock

    def controller_changed(self) -> None:
        """Another controller took over (called from the etcd thread): the main thread leaves
        the pipeline at its next look, and joins the new one when it can; without a way to
        find it, it exits to be restarted."""
        if self._next_controller is None:
            logger.warning("the controller changed; exiting to re-register")
            logging.shutdown()
            os._exit(EXIT_PIPELINE_BROKEN)
        self._changed.set()

    def _check_controller(self) -> None:
        if self._changed.is_set():
            raise ControllerChanged

    def _check_silence(self, when: str) -> None:
        """ControllerLost once the controller has said nothing for controller_timeout_s: it
        pings every worker holding a place, starting or serving (a restarted one at the same
        address never heard this worker's hello)."""
        silent_s = time.monotonic() - self._control.heard_s
        if silent_s > self.config.controller_timeout_s:
            raise ControllerLost(f"no message from the controller for {silent_s:.1f} s {when}")

    def _check_silence_joining(self, when: str) -> None:
        """_check_silence before serving. In cluster mode a silent controller's successor is
        joined in this process (ControllerChanged) if etcd names one within the timeout, as
        while serving (_after_controller_lost); a lease longer than the timeout may name it
        later than the silence shows."""
        try:
            self._check_silence(when)
        except ControllerLost:
            timeout_s = self.config.controller_timeout_s
            if self._next_controller is not None and self._changed.wait(timeout_s):
                raise ControllerChanged from None
            raise

    def _send(self, msg: stage_pb2.WorkerMessage) -> None:
        self._control.send(msg)

    def _recv(self, timeout_s: float | None = None) -> stage_pb2.ControllerMessage | None:
        return self._control.recv(timeout_s)

    def _heartbeat(self, step_busy_s: float) -> None:
        assert self.shard is not None
        self._send(
            stage_pb2.WorkerMessage(
                heartbeat=stage_pb2.Heartbeat(
                    worker_id=self.worker_id,
                    stage=self.shard.stage,
                    tp_rank=self.shard.tp_rank,
                    last_batch_id=self._last_batch_id,
                    step_busy_s=step_busy_s,
                    busy_s_total=self._busy_s_total,
                    uptime_s=time.monotonic() - self._start_s,
                    phases=self._timer.totals() if self._timer else None,
                    cache_ready=self._cache_ready,
                )
            )
        )

    # ---- start-up --------------------------------------------------------------------------
    def _handshake(self) -> stage_pb2.WorkerAssignment:
        cfg = self.config
        self._send(
            stage_pb2.WorkerMessage(
                hello=stage_pb2.WorkerHello(
                    worker_id=self.worker_id,
                    host=cfg.advertise_host or route_address(self._controller_addr),
                    stage=cfg.stage,
                    tp_rank=cfg.tp_rank,
                    model=os.path.basename(os.path.normpath(cfg.model_dir)),
                    device=cfg.device,
                )
            )
        )
        heard = False  # before the controller has answered, it may not be up yet
        while True:
            msg = self._recv(IDLE_HEARTBEAT_S)
            if msg is None:
                self._check_controller()
                if heard:
                    self._check_silence_joining("while waiting for an assignment")
                continue
            heard = True
            if msg.HasField("assignment"):
                return msg.assignment
            if msg.HasField("shutdown"):
                raise SystemExit(0)
            if msg.HasField("reject"):
                raise WorkerRejected(f"the controller refused this worker: {msg.reject.reason}")
            if not msg.HasField("ping"):  # a ping: the controller checking this worker is there
                logger.warning("ignoring %s before the assignment", msg.WhichOneof("body"))

    def _load(self, shard: ShardSpec, tp_group: TPGroup) -> StageModel:
        cfg = self.config
        spec, dtype = load_spec(cfg.model_dir), DTYPES[cfg.dtype]
        # first: pack() follows what it measures
        bf16_layouts.choose(
            spec, shard, tp_group, cfg.device, dtype, cfg.kv_cache_bytes, cfg.workers_on_host
        )
        t0 = time.monotonic()
        reader = CheckpointReader(cfg.model_dir)
        try:
            model = build_stage(spec, shard, tp_group, cfg.device, dtype, reader)
        finally:
            reader.close()
        load_s = time.monotonic() - t0
        logger.info(
            "loaded layers %d..%d (%.1f MiB, and %.1f MiB of them again in kernels' layouts) "
            "on %s in %.2f s",
            model.layer_ids.start,
            model.layer_ids.stop - 1,
            model.param_bytes / 2**20,
            model.kernel_copy_bytes / 2**20,
            cfg.device,
            load_s,
        )
        return model

    def run(self) -> int:
        cfg = self.config
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        if cfg.small_batch_kernel:
            gemv.enable()
        fused.set_enabled(cfg.fused_ops)
        cpu_matmul.set_enabled(cfg.cpu_matmul_kernel)
        llama_cpu_loop.set_enabled(cfg.cpu_layer_loop)
        self._control.start()
        try:
            while True:
                try:
                    return self._join_and_serve()
                except ControllerChanged:
                    pass  # out of the handler first: its traceback holds the old KV cache
                self._rejoin()
        finally:
            self._control.stop()

    def _rejoin(self) -> None:
        """Leaves the old controller's socket and connects to the one that took over."""
        assert self._next_controller is not None
        self._control.close()
        if self.config.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the old KV cache's memory, for the new one to measure
        addr = self._next_controller(max(30.0, 3 * self.config.controller_timeout_s))
        # Every change up to this controller was told before its address was handed out.
        self._changed.clear()
        logger.info("joining the controller at %s", addr)
        self._controller_addr = addr
        self._control.reconnect(self._connect(addr))

    def _join_and_serve(self) -> int:
        """Hello, assignment, torch.distributed, weights, KV cache, then serving until the
        controller says stop (0), goes silent (ControllerLost) or is replaced (ControllerChanged:
        the distributed world is left first, so the next one can form)."""
        cfg = self.config
        assignment = self._handshake()
        shard = ShardSpec(
            assignment.pp,
            assignment.tp,
            assignment.stage,
            assignment.tp_rank,
            tuple(assignment.layer_split),
        )
        self.shard = shard
        _LOG_TAG.tag = f"s{shard.stage}r{shard.tp_rank}"
        # Refuse a model that cannot be split before joining (and holding up) the other ranks.
        spec = load_spec(cfg.model_dir)
        shard.check_heads(spec)
        layers = shard.layer_range(spec)
        logger.info(
            "stage %d tp_rank %d of pp=%d tp=%d: layers %d..%d (%d of %d)",
            shard.stage, shard.tp_rank, shard.pp, shard.tp,
            layers.start, layers.stop - 1, len(layers), spec.num_layers,
        )  # fmt: skip
        if assignment.socket_ifname:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", assignment.socket_ifname)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", assignment.socket_ifname)
        backend = choose_backend(cfg.comm_backend, cfg.device)
        with self._until_told_to_leave("joining torch.distributed"):
            tp_group = init_distributed(shard, assignment.dist_init_method, cfg.device, backend)
        try:
            return self._serve_pipeline(shard, tp_group, backend)
        except ControllerChanged:
            self._leave_pipeline(None)  # left already when it came while serving: a no-op
            raise

    def _serve_pipeline(self, shard: ShardSpec, tp_group: TPGroup, backend: str) -> int:
        cfg = self.config
        with self._until_told_to_leave("loading the stage"):
            model = self._stage_model(shard, tp_group)
        spec = model.spec
        dtype = DTYPES[cfg.dtype]
        per_block = bytes_per_block(
            len(model.layers), cfg.block_size_hint, model.num_kv_heads_local, spec.head_dim, dtype
        )
        num_blocks = num_blocks_that_fit(
            cfg.device, per_block, cfg.kv_cache_bytes, cfg.gpu_cache_fraction
        )
        self._send(
            stage_pb2.WorkerMessage(
                ready=stage_pb2.WorkerReady(num_kv_blocks=num_blocks, param_bytes=model.param_bytes)
            )
        )
        cache_msg = self._await_cache()
        if cache_msg is None:  # shut down before serving
            destroy_distributed()
            return 0
        cache = self._allocate_cache(
            cache_msg, len(model.layers), model.num_kv_heads_local, spec.head_dim, dtype
        )
        attention = make_backend(cfg.attention, cfg.device)
        # CUDA kernels run asynchronously: timing attention and the linear layers there would
        # time their launches, so on CUDA the forward pass is reported whole.
        timed = TimedAttention(attention) if cfg.device == "cpu" else None
        self._timer = StepTimer(timed)
        graphs = self._graphs(model, cache)
        runner = StageRunner(model, cache, timed or attention, graphs, cfg.model_dir)
        via_host = backend == "gloo" and cfg.device.startswith("cuda")
        links = PipelineLinks(shard, tp_group, cfg.send_slices, via_host)
        try:
            code = self._serve(runner, links)
        except ControllerChanged:
            self._leave_pipeline(links)
            raise
        except ControllerLost as lost:
            self._after_controller_lost(links, lost)
        except StepFaulted as fault:
            self._after_step_fault(fault)
        except Exception:
            self._after_pipeline_broke(links)
        self._leave_pipeline(links)
        return code

    def _allocate_cache(
        self,
        assigned: stage_pb2.CacheAssignment,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> KVCache:
        """The KV cache, zeroed with heartbeats that say it is not ready yet, then one that
        says it is: the controller is not serving until every worker has sent that one."""
        self._cache_ready = False
        with self._control.busy():  # one allocation or chunk can outlast a heartbeat timeout
            cache = KVCache(
                num_layers,
                assigned.num_kv_blocks,
                assigned.block_size,
                kv_heads,
                head_dim,
                self.config.device,
                dtype,
                progress=self._keep_alive(),
            )
        self._cache_ready = True
        self._heartbeat(0.0)  # at once, not at the controller's next ping
        return cache

    def _keep_alive(self) -> Callable[[], None]:
        """A callback for long start-up work (zeroing the KV cache): a heartbeat at most every
        IDLE_HEARTBEAT_S, so that the controller, which counts from the cache assignment,
        does not take the worker for dead."""
        last_s = time.monotonic()

        def beat() -> None:
            nonlocal last_s
            if time.monotonic() - last_s >= IDLE_HEARTBEAT_S:
                self._heartbeat(0.0)
                last_s = time.monotonic()

        return beat

    @contextlib.contextmanager
    def _until_told_to_leave(self, what: str) -> Iterator[None]:
        """Joining torch.distributed and loading take long and do not read the socket. A
        shutdown meanwhile means the controller started the rebuild over (a worker of this
        world is gone: the join would wait for it until its timeout), so the process exits, to
        be restarted, as after a broken pipeline. The keepalive thread reads it, and says the
        worker lives meanwhile."""

        def told() -> None:
            logger.warning("the controller started over while %s; exiting", what)
            logging.shutdown()
            os._exit(EXIT_PIPELINE_BROKEN)

        with self._control.busy(), self._control.hearing(None, lambda: None, told):
            yield

    def _after_controller_lost(self, links: PipelineLinks, lost: ControllerLost) -> NoReturn:
        """A dead controller's silence and its key's change in etcd come about together (its
        heartbeat timeout and its lease): whichever is seen first, a successor is joined in
        this process. Silence with the key unchanged ends the process (ControllerLost)."""
        if self._next_controller is None or not self._changed.wait(
            self.config.controller_timeout_s
        ):
            raise lost
        self._leave_pipeline(links)
        raise ControllerChanged from None

    def _after_pipeline_broke(self, links: PipelineLinks) -> NoReturn:
        if self._changed.is_set():
            # A peer left first for the new controller: the break is expected; the watchdog
            # in _leave_pipeline still ends the process if leaving hangs.
            logger.warning("the pipeline broke as the controller changed; leaving it")
            self._leave_pipeline(links)
            raise ControllerChanged from None
        # A peer died mid-step (gloo/NCCL error): torch.distributed cannot be trusted to clean
        # up, so leave at once; the supervisor restarts this worker, which registers again and
        # joins the rebuilt pipeline.
        logger.exception("the pipeline broke; exiting to be restarted")
        logging.shutdown()
        os._exit(EXIT_PIPELINE_BROKEN)

    def _after_step_fault(self, fault: StepFaulted) -> NoReturn:
        """This worker's step raised. The peers mid-step with it wait for activations or an
        all-reduce that will not come, and torch.distributed cannot be trusted after that, so
        the worker exits to be restarted, as after a broken link; first it tells the controller
        which micro-batch failed, so that its requests are quarantined rather than requeued to
        fail the rebuilt pipeline again."""
        logger.error("%s; telling the controller, then exiting", fault, exc_info=fault)
        assert self.shard is not None
        report = stage_pb2.StepFault(
            batch_id=fault.batch_id,
            stage=self.shard.stage,
            tp_rank=self.shard.tp_rank,
            error=f"{type(fault.cause).__name__}: {fault.cause}"[:_MAX_FAULT_TEXT],
        )
        try:
            self._control.send_last(stage_pb2.WorkerMessage(fault=report), _FAULT_LINGER_S)
        except zmq.ZMQError as err:
            logger.warning("the step fault could not be sent: %s", err)
        logging.shutdown()
        os._exit(EXIT_PIPELINE_BROKEN)

    def _await_cache(self) -> stage_pb2.CacheAssignment | None:
        """The KV-cache size every worker allocates, or None when told to shut down first."""
        while True:
            msg = self._recv(IDLE_HEARTBEAT_S)
            if msg is None:
                self._check_controller()
                self._check_silence_joining("while waiting for the KV cache's size")
                continue
            if msg.HasField("cache"):
                return msg.cache
            if msg.HasField("shutdown"):
                return None

    def _leave_pipeline(self, links: PipelineLinks | None) -> None:
        """Pending sends, then the distributed world; a peer that never answers ends the
        process (the watchdog) rather than this worker."""
        with self._watchdog.guard("leaving the pipeline", self.config.controller_timeout_s):
            if links is not None:
                try:
                    links.wait_sends()
                except RuntimeError as err:  # the next stage is already gone
                    logger.warning("pending activation sends failed at shutdown: %s", err)
            destroy_distributed()

    def _stage_model(self, shard: ShardSpec, tp_group: TPGroup) -> StageModel:
        """The same stage as before (TP=1: its layers hold no group) is kept; else loaded."""
        model = self._model
        if model is not None and model.shard == shard and shard.tp == 1:
            logger.info("keeping the loaded layers of stage %d", shard.stage)
            return model
        self._model = None  # free the old stage's weights before loading the new ones
        model = self._load(shard, tp_group)
        self._model = model
        return model

    def _graphs(self, model: StageModel, cache: KVCache) -> DecodeGraphs | None:
        if not (self.config.cuda_graphs and self.config.device.startswith("cuda")):
            return None
        if model.shard.tp > 1:
            # Capturing the TP all-reduce needs NCCL's graph support, not yet run on hardware.
            logger.info("CUDA graphs off: TP=%d (graphs run with TP=1 only)", model.shard.tp)
            return None
        return DecodeGraphs(model, cache, self.config.attention)

    # ---- serving ---------------------------------------------------------------------------
    def _serve(self, runner: StageRunner, links: PipelineLinks) -> int:
        self._control.heard_s = time.monotonic()
        self._refused_plan = False
        while True:
            msg = self._recv(IDLE_HEARTBEAT_S)
            self._check_controller()
            if msg is None:
                self._check_silence("while serving")
                self._heartbeat(0.0)
                continue
            if msg.HasField("ping"):
                self._heartbeat(0.0)  # the answer that tells the controller this worker lives
                continue
            if msg.HasField("shutdown"):
                logger.info("shutdown after batch %d", self._last_batch_id)
                return 0
            if not msg.HasField("plan"):
                logger.warning("ignoring %s while serving", msg.WhichOneof("body"))
                continue
            with self._control.busy():
                self._run_plan(runner, links, msg.plan)

    def _run_plan(
        self, runner: StageRunner, links: PipelineLinks, plan: stage_pb2.StepPlan
    ) -> None:
        """One step, its phases timed (step_timer.py), then the heartbeat that reports it."""
        shard = runner.model.shard
        if self._refused_plan:
            # A plan after one this stage refused: the controller takes the pipeline down. A
            # stage that took the refused plan waits for its activations; these would be read
            # as them (the link carries no batch id).
            logger.info("skipping plan %d after a refused one", plan.batch_id)
            return
        timer = self._timer
        assert timer is not None
        timer.begin(self._control.received_at)
        try:
            with step_faults(plan.batch_id):
                step = runner.prepare(plan)
        except PlanError as err:
            # Most checks are every stage's, but some only stage 0's (the token ids it embeds):
            # each refusing stage says so at once, and the controller takes the pipeline down,
            # so no stage waits long for activations that will not come.
            logger.error("rejected plan: %s", err)
            self._refused_plan = True
            if shard.tp_rank == 0:
                refused = stage_pb2.StepResult(batch_id=plan.batch_id, rejected=True)
                self._send(stage_pb2.WorkerMessage(result=refused))
            return
        timer.prepare_s += timer.lap()
        hidden_in = None
        if not shard.is_first:
            # Waiting for the previous stage is idle time, not busy time.
            waiting = "receiving the previous stage's activations"
            with self._waiting_on(waiting, PeerWait(shard.stage - 1, plan.batch_id)):
                hidden_in = links.recv(
                    step.meta.num_tokens,
                    runner.model.spec.hidden_size,
                    runner.model.dtype,
                    runner.model.device,
                )
            timer.recv_wait_s += timer.lap()
        t0 = time.monotonic()
        with step_faults(plan.batch_id):
            hidden = runner.forward(step, hidden_in)
        timer.forward_s += timer.lap()
        if shard.is_last:
            with step_faults(plan.batch_id):
                self._sample_and_send(runner, step, hidden, timer)
        else:
            # The send first waits for our last one, which the next stage takes in its step.
            sending = PeerWait(shard.stage + 1, self._last_batch_id)
            # The step's own kernels may fail only now, in the send that waits for them.
            with (
                self._waiting_on("sending activations to the next stage", sending),
                device_faults(plan.batch_id),
            ):
                links.send(hidden)
        timer.send_s += timer.lap()
        if runner.model.device.startswith("cuda"):
            with step_faults(plan.batch_id):  # an asynchronous kernel error surfaces here
                torch.cuda.synchronize()
            timer.forward_s += timer.lap()  # the wait for the queued kernels
        timer.end(step.meta.num_tokens)
        busy_s = time.monotonic() - t0
        self._busy_s_total += busy_s
        self._last_batch_id = plan.batch_id
        self._heartbeat(busy_s)

    @contextlib.contextmanager
    def _waiting_on(self, what: str, wait: PeerWait) -> Iterator[None]:
        """A wait on a neighbouring stage. The watchdog ends it after the peer wait (a cut
        link) unless the controller's pings keep saying that the neighbour is still stepping
        what comes first (a long step there, on a slow CPU or of a whole prompt), and at once
        when the controller takes the pipeline down (the process exits to be restarted, as
        after a broken link)."""
        dog = self._watchdog
        with dog.guard(what, self._peer_wait_s) as guard:
            renew = functools.partial(dog.renew, guard, self._peer_wait_s)
            down = functools.partial(dog.expire, guard, "the controller took the pipeline down")
            with self._control.hearing(wait, renew, down):
                yield

    def _sample_and_send(
        self, runner: StageRunner, step: PreparedStep, hidden: torch.Tensor, timer: StepTimer
    ) -> None:
        """Last stage: logits and sampling at the rows that yield a token; TP rank 0 sends them."""
        tokens: list[tuple[int, int]] = []
        logprobs: list[TokenLogprobs | None] = []
        if step.sample_rows:
            logits = runner.logits(step, hidden)
            timer.logits_s += timer.lap()
            tokens = runner.sample(step, logits)
            logprobs = runner.logprobs(step, logits, [token_id for _, token_id in tokens])
            timer.sample_s += timer.lap()
        if runner.model.shard.tp_rank == 0:
            result = stage_pb2.StepResult(
                batch_id=step.batch_id,
                seq_ids=[seq_id for seq_id, _ in tokens],
                token_ids=[token_id for _, token_id in tokens],
            )
            pack_logprobs(result, logprobs)
            if step.prompt_chunks:
                pack_prompt_logprobs(result, prompt_logprobs(runner, step, hidden))
            self._send(stage_pb2.WorkerMessage(result=result))


@contextlib.contextmanager
def step_faults(batch_id: int) -> Iterator[None]:
    """An exception of the step's own work becomes StepFaulted (the controller hears of it);
    a refused plan and a broken link (a peer or the controller gone) pass as they are. The
    links to peers also run inside the forward pass with TP > 1 (all-reduce): a failure there
    that torch does not raise as a distributed error is reported as a fault too, which costs
    the requests of that micro-batch a trial alone (quarantine.py), not their answers."""
    try:
        yield
    except (PlanError, zmq.ZMQError, torch.distributed.DistError):
        raise
    except Exception as err:
        raise StepFaulted(batch_id, err) from err


# torch >= 2.8 raises a device's errors as AcceleratorError; before, as a RuntimeError saying so.
_ACCELERATOR_ERROR: type[Exception] = getattr(torch, "AcceleratorError", RuntimeError)


def is_device_error(err: Exception) -> bool:
    return isinstance(err, _ACCELERATOR_ERROR) and (
        _ACCELERATOR_ERROR is not RuntimeError or "CUDA error" in str(err)
    )


@contextlib.contextmanager
def device_faults(batch_id: int) -> Iterator[None]:
    """Around a link to a peer on CUDA: kernels run asynchronously, and an error of the step's
    own (a device-side assert, an illegal address) may first surface in the send that waits for
    them; that one becomes StepFaulted, a broken link passes as it is."""
    try:
        yield
    except Exception as err:
        if is_device_error(err):
            raise StepFaulted(batch_id, err) from err
        raise


def pack_logprobs(result: stage_pb2.StepResult, logprobs: list[TokenLogprobs | None]) -> None:
    """The rows that asked for log-probabilities, as StepResult's packed columns."""
    for row, entry in enumerate(logprobs):
        if entry is not None:
            result.logprob_rows.append(row)
            result.logprobs.append(entry.logprob)
            result.top_counts.append(len(entry.top_token_ids))
            result.top_token_ids.extend(entry.top_token_ids)
            result.top_logprobs.extend(entry.top_logprobs)


def pack_prompt_logprobs(
    result: stage_pb2.StepResult, chunks: list[tuple[int, int, list[TokenLogprobs]]]
) -> None:
    for seq_id, first_position, entries in chunks:
        chunk = result.prompt_logprobs.add(seq_id=seq_id, first_position=first_position)
        chunk.top_k = len(entries[0].top_token_ids) if entries else 0
        for entry in entries:
            chunk.logprobs.append(entry.logprob)
            chunk.top_token_ids.extend(entry.top_token_ids)
            chunk.top_logprobs.extend(entry.top_logprobs)
