"""Wires one controller together: gRPC API, control plane, pipeline start-up, engine, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import zmq.asyncio
from grpc import aio as grpc_aio
from grpc_health.v1 import health as grpc_health
from sarathi_proto import stage_pb2

from controller.api_request import RequestLimits
from controller.bind_error import BindError
from controller.cluster_membership import ControllerMembership, LeadershipLost
from controller.config import ControllerConfig, ServerConfig
from controller.engine import Engine, GenerationRequest
from controller.executor.control_channel import ControlChannel
from controller.executor.curve import CurveServerKeys
from controller.executor.pipeline import PipelineExecutor
from controller.health_watch import watch_health
from controller.kube_events import start_kube_events
from controller.metrics import ControllerMetrics
from controller.openai_api import HttpApiServer, HttpApiState, start_http_server
from controller.overload_watch import OverloadTracker, watch_overload
from controller.pipeline_events import PipelineEvents
from controller.scheduler import ConfigError, Scheduler
from controller.security import read_tokens, server_credentials
from controller.server import GenerationService, mark_alive, mark_serving, start_grpc_server
from controller.stage_report import publish_stage_metrics
from controller.step_log import StepLog
from controller.task_watch import FailureHandler, TaskFailed, start_watched
from controller.tokenizer import TextStream, Tokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")


def free_tcp_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def read_model_config(model_dir: str) -> dict[str, object]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError("model_dir", model_dir, "a folder with config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError("model_dir", model_dir, f"a readable config.json ({err})") from err
    if not isinstance(config, dict):
        raise ConfigError("model_dir", model_dir, "a config.json that holds an object")
    return config


def config_int(model_config: dict[str, object], key: str, model_dir: str, default: int = -1) -> int:
    """An integer field of config.json; ConfigError naming it when it is missing (and has no
    default) or not an integer."""
    value = model_config.get(key)
    if value is None and default >= 0:  # missing, or null as transformers writes some fields
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError("model_dir", model_dir, f"a config.json whose {key} is an integer >= 0")
    return value


@dataclass
class ServedModel:
    """What the controller reads of the model folder (it loads no weights)."""

    name: str
    """The folder's name: the model id clients see."""
    vocab_size: int
    tokenizer: Tokenizer

    @classmethod
    def load(cls, config: ControllerConfig) -> ServedModel:
        model_config = read_model_config(config.model_dir)
        vocab_size = config_int(model_config, "vocab_size", config.model_dir)
        max_positions = config_int(model_config, "max_position_embeddings", config.model_dir, 0)
        if max_positions and config.scheduler.max_model_len > max_positions:
            raise ConfigError(
                "max_model_len",
                config.scheduler.max_model_len,
                f"at most the model's max_position_embeddings={max_positions}",
            )
        tokenizer = Tokenizer.from_dir(config.model_dir)
        return cls(Path(config.model_dir).name, vocab_size, tokenizer)


@dataclass
class Apis:
    """The client-facing servers: they listen from the start and answer 'not ready' until the
    pipeline serves."""

    service: GenerationService
    grpc_server: grpc_aio.Server
    grpc_port: int
    health: grpc_health.HealthServicer
    http_state: HttpApiState
    metrics: ControllerMetrics
    http_server: HttpApiServer | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def publish(self, problem: str, stuck: bool) -> None:
        """The health watch's verdict: "" serves, anything else says why not; stuck (a stall,
        or a rebuild past the worker start timeout) also marks the process unhealthy
        (liveness)."""
        self.service.problem = problem
        mark_serving(self.health, serving=not problem)
        mark_alive(self.health, alive=not stuck)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.http_server is not None:
            await self.http_server.stop()
        await self.grpc_server.stop(grace=1.0)


async def start_apis(
    config: ControllerConfig, model_name: str, on_task_failed: FailureHandler
) -> Apis:
    """on_task_failed: called with the name of an API task that raised (task_watch.py)."""
    server = config.server
    service = GenerationService(model_name)
    tokens = read_tokens(server.auth_token_file)
    credentials = server_credentials(server.tls_cert_file, server.tls_key_file)
    grpc_server, port, health = await start_grpc_server(
        service, server.host, server.port, credentials, tokens
    )
    log.info(
        "gRPC API listening on %s:%d (not serving until the pipeline is up)", server.host, port
    )
    metrics = ControllerMetrics()
    http_state = HttpApiState(model_name, api_keys=tokens, metrics=metrics.exposition)
    apis = Apis(service, grpc_server, port, health, http_state, metrics)
    try:
        await start_http_apis(apis, server, on_task_failed)
    except BindError:
        await apis.stop()  # whatever did start, so that the error is all the controller says
        raise
    return apis


async def start_http_apis(apis: Apis, server: ServerConfig, on_task_failed: FailureHandler) -> None:
    """The OpenAI-compatible HTTP API and the metrics port, where configured."""
    if server.http_port:
        tls = (server.tls_cert_file, server.tls_key_file) if server.tls_cert_file else None
        apis.http_server = await start_http_server(
            apis.http_state, server.host, server.http_port, on_task_failed, tls
        )
        log.info(
            "OpenAI-compatible HTTP API and /metrics on %s:%d%s",
            server.host,
            apis.http_server.port,
            " (HTTPS)" if tls else "",
        )
    if server.metrics_port:
        apis.metrics.serve(server.metrics_port, server.host)
        log.info("Prometheus metrics on %s:%d/metrics", server.host, server.metrics_port)


def make_pipeline(
    config: ControllerConfig, channel: ControlChannel, model_name: str
) -> PipelineExecutor:
    cluster_mode = bool(config.server.etcd)
    dist_port = config.server.dist_port or (29500 if cluster_mode else free_tcp_port("127.0.0.1"))
    return PipelineExecutor(
        channel,
        config.parallel,
        # Cluster mode: workers started elsewhere must serve this model; local mode started them.
        model=model_name if cluster_mode else "",
        dist_host=config.server.dist_host or ("" if cluster_mode else "127.0.0.1"),
        dist_port=dist_port,
        socket_ifname=config.server.socket_ifname,
        heartbeat_timeout_s=config.server.heartbeat_timeout_s,
        new_dist_port=None if cluster_mode else lambda: free_tcp_port("127.0.0.1"),
        step_log=(
            StepLog.open(config.server.step_log_file, config.parallel.pp)
            if config.server.step_log_file
            else None
        ),
    )


async def join_cluster(
    config: ControllerConfig,
    channel: ControlChannel,
    apis: Apis,
    model_name: str,
    stop: asyncio.Event,
) -> ControllerMembership | None:
    """Cluster mode: wait to be the active controller (a standby until the active one's lease
    ends), then publish this controller in etcd so workers find it. None in local mode, or when
    stopped while a standby."""
    if not config.server.etcd:
        return None
    membership = ControllerMembership(
        config.server.etcd, config.server.cluster, config.server.leader_lease_s
    )
    await membership.connect()
    control_port = channel.address.rsplit(":", 1)[1]
    endpoint = stage_pb2.ControllerEndpoint(
        control_addr=f"tcp://{config.server.advertise_host}:{control_port}",
        grpc_addr=f"{config.server.advertise_host}:{apis.grpc_port}",
        model=model_name,
        pp=config.parallel.pp,
        tp=config.parallel.tp,
    )

    def standby(active: stage_pb2.ControllerEndpoint) -> None:
        apis.service.problem = f"standby: the active controller is {active.grpc_addr}"

    await until_stopped(membership.lead(endpoint, standby), stop)
    if not membership.is_leader:  # stopped first
        await membership.close()
        return None
    apis.service.problem = "the pipeline is not ready yet"
    return membership


async def until_stopped(work: Coroutine[object, object, T], stop: asyncio.Event) -> T | None:
    """work's result, or None when `stop` is set first (work is then cancelled)."""
    task = asyncio.create_task(work)
    stopped = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task not in done:
        task.cancel()
        return None
    return task.result()


async def wait_for_workers(
    config: ControllerConfig,
    pipeline: PipelineExecutor,
    apis: Apis,
    stop: asyncio.Event,
    events: PipelineEvents,
) -> int | None:
    """KV blocks per worker once every worker is present and loaded; None if stopped first."""

    def starting_with_refusal(reason: str) -> None:
        # Until the health watch runs, Status shows why the pipeline is not forming.
        if not pipeline.up:
            apis.service.problem = f"the pipeline is not ready yet; {reason}"
        events.worker_refused(reason, *pipeline.last_refused)

    pipeline.on_refused = starting_with_refusal
    return await until_stopped(pipeline.start(config.server.worker_start_timeout_s), stop)


async def begin_serving(
    config: ControllerConfig,
    pipeline: PipelineExecutor,
    num_blocks: int,
    model: ServedModel,
    apis: Apis,
    on_task_failed: FailureHandler,
    events: PipelineEvents,
) -> Engine:
    """Builds the scheduler and engine over the ready pipeline and opens both APIs to requests;
    on_task_failed is called if the engine loop or a watch beside it raises."""
    cache = dataclasses.replace(config.cache, num_blocks=num_blocks, prefix_salt=model.name)
    scheduler = Scheduler(config.scheduler, cache)

    def make_text_stream(request: GenerationRequest) -> TextStream:
        return TextStream(model.tokenizer, request.stop)

    engine = Engine(
        scheduler,
        pipeline,
        make_text_stream,
        apis.metrics,
        admission=config.admission,
        phases=pipeline.phases,
    )
    report_failures(pipeline, engine, events)
    await pipeline.begin_serving(num_blocks, cache.block_size, engine.on_result)
    limits = RequestLimits(
        vocab_size=model.vocab_size,
        default_max_tokens=config.server.default_max_tokens,
        max_stop_strings=config.server.max_stop_strings,
        max_stop_string_chars=config.server.max_stop_string_chars,
        eos_token_ids=frozenset(model.tokenizer.eos_token_ids),
        max_model_len=scheduler.config.max_model_len,
    )
    apis.service.attach(engine, pipeline, limits, model.tokenizer.encode_prompt)
    apis.http_state.attach(engine, limits, model.tokenizer)
    apis.http_state.queue_full = engine.queue_full
    apis.http_state.retry_after_s = engine.admission.retry_after_s
    tracker = OverloadTracker(events.overload_started, events.overload_ended)
    apis.tasks += [
        start_watched(engine.run(), "engine", on_task_failed),
        start_watched(
            watch_health(
                engine,
                pipeline,
                config.server.stall_timeout_s,
                config.server.worker_start_timeout_s,
                apis.publish,
            ),
            "health",
            on_task_failed,
        ),
        start_watched(publish_stage_metrics(engine, pipeline), "stage-metrics", on_task_failed),
        start_watched(watch_overload(engine, tracker), "overload-watch", on_task_failed),
    ]
    log.info(
        "serving %s: pp=%d tp=%d, %d KV blocks of %d tokens, policy %s, budget %d (idle %d)",
        model.name, config.parallel.pp, config.parallel.tp, num_blocks, cache.block_size,
        config.scheduler.policy, config.scheduler.budget_tokens,
        config.scheduler.idle_budget_tokens,
    )  # fmt: skip
    return engine


def report_failures(pipeline: PipelineExecutor, engine: Engine, events: PipelineEvents) -> None:
    """A stage down requeues the engine's requests; both it and the rebuild become events. A
    micro-batch that failed on a worker is the engine's to quarantine first."""
    requeued = 0

    def down(reason: str) -> None:
        nonlocal requeued
        requeued = engine.on_pipeline_down()
        log.warning("%d requests requeued for recompute", requeued)
        events.stage_down(reason, pipeline.down_stages)

    def up() -> None:
        engine.on_pipeline_up()
        down_s = time.monotonic() - pipeline.down_since_s
        events.rebuilt(pipeline.num_rebuilds, down_s, requeued, pipeline.parallel.pp)

    pipeline.on_down, pipeline.on_up = down, up
    pipeline.on_step_fault = engine.on_step_fault


async def end_streams(apis: Apis, engine: Engine | None) -> None:
    """Open streams end with UNAVAILABLE, not a cut connection."""
    apis.service.shutting_down = True
    if engine is not None:
        for request_id in engine.running_request_ids():
            engine.abort(request_id)
        await asyncio.sleep(0.05)


async def serve(config: ControllerConfig, stop: asyncio.Event | None = None) -> None:
    """Runs until `stop` is set (or SIGINT/SIGTERM), then shuts the workers down."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    failed_tasks: list[str] = []

    def task_failed(name: str) -> None:
        # A long-lived task raised (logged by task_watch.py): without it the controller would
        # stay up with part of its work silently stopped. Stop, exit non-zero, be restarted
        # (the workers join the new controller; clients resume their streams).
        failed_tasks.append(name)
        stop.set()

    model = ServedModel.load(config)
    event_sink = start_kube_events(os.environ)
    events = PipelineEvents(event_sink)
    apis = await start_apis(config, model.name, task_failed)
    ctx = zmq.asyncio.Context()
    curve = None
    if config.server.curve_secret_key_file:
        curve = CurveServerKeys(
            config.server.curve_secret_key_file, config.server.curve_client_keys_dir
        )
    channel = ControlChannel(ctx, config.server.control_addr, curve)
    pipeline = make_pipeline(config, channel, model.name)
    pipeline.on_task_failed = task_failed
    membership: ControllerMembership | None = None
    engine: Engine | None = None
    lost_leadership = asyncio.Event()
    try:
        membership = await join_cluster(config, channel, apis, model.name, stop)
        if membership is not None:
            membership.on_task_failed = task_failed

            def step_down() -> None:
                lost_leadership.set()
                stop.set()

            membership.on_leadership_lost = step_down
        elif config.server.etcd:
            return  # stopped while a standby
        num_blocks = await wait_for_workers(config, pipeline, apis, stop, events)
        if num_blocks is None:
            return
        engine = await begin_serving(config, pipeline, num_blocks, model, apis, task_failed, events)
        await stop.wait()
    finally:
        log.info("shutting down")
        await end_streams(apis, engine)
        await apis.stop()
        await pipeline.shutdown()
        if membership is not None:
            await membership.close()
        channel.close()
        ctx.term()
        await asyncio.to_thread(event_sink.close)  # what is queued is posted, briefly
    raise_why_stopped(lost_leadership, failed_tasks)


def raise_why_stopped(lost_leadership: asyncio.Event, failed_tasks: list[str]) -> None:
    """A stop that was not asked for ends the process non-zero, so it is restarted."""
    if lost_leadership.is_set():
        raise LeadershipLost("the leader lease in etcd ended; stopped so that one active remains")
    if failed_tasks:
        raise TaskFailed(f"the {failed_tasks[0]} task failed (logged above)")
