"""Wires one controller together: gRPC API, control plane, pipeline start-up, engine, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from pathlib import Path

import zmq.asyncio
from sarathi_proto import stage_pb2

from controller.api_request import RequestLimits
from controller.cluster_membership import ControllerMembership
from controller.config import ControllerConfig
from controller.engine import Engine, GenerationRequest
from controller.executor.control_channel import ControlChannel
from controller.executor.curve import CurveServerKeys
from controller.executor.pipeline import PipelineExecutor
from controller.health_watch import watch_health
from controller.metrics import ControllerMetrics
from controller.openai_api import HttpApiServer, HttpApiState, start_http_server
from controller.scheduler import CacheConfig, ConfigError, Scheduler
from controller.security import read_tokens, server_credentials
from controller.server import GenerationService, mark_serving, start_grpc_server
from controller.tokenizer import TextStream, Tokenizer

log = logging.getLogger(__name__)


def free_tcp_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def read_model_config(model_dir: str) -> dict[str, object]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError("model_dir", model_dir, "a folder with config.json")
    config: dict[str, object] = json.loads(path.read_text())
    return config


async def serve(config: ControllerConfig, stop: asyncio.Event | None = None) -> None:
    """Runs until `stop` is set (or SIGINT/SIGTERM), then shuts the workers down."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    model_config = read_model_config(config.model_dir)
    vocab_size = int(model_config["vocab_size"])  # type: ignore[call-overload]
    max_positions = int(model_config.get("max_position_embeddings", 0) or 0)  # type: ignore[call-overload]
    if max_positions and config.scheduler.max_model_len > max_positions:
        raise ConfigError(
            "max_model_len",
            config.scheduler.max_model_len,
            f"at most the model's max_position_embeddings={max_positions}",
        )
    tokenizer = Tokenizer.from_dir(config.model_dir)

    def make_text_stream(request: GenerationRequest) -> TextStream:
        return TextStream(tokenizer, request.stop)

    model_name = Path(config.model_dir).name

    service = GenerationService(model_name)
    tokens = read_tokens(config.server.auth_token_file)
    server, port, health = await start_grpc_server(
        service,
        config.server.host,
        config.server.port,
        server_credentials(config.server.tls_cert_file, config.server.tls_key_file),
        tokens,
    )
    log.info(
        "gRPC API listening on %s:%d (not serving until the pipeline is up)",
        config.server.host,
        port,
    )
    http_state = HttpApiState(model_name, api_keys=tokens)
    http_server: HttpApiServer | None = None
    if config.server.http_port:
        http_server = await start_http_server(
            http_state, config.server.host, config.server.http_port
        )
        log.info("OpenAI-compatible HTTP API on %s:%d", config.server.host, http_server.port)
    metrics = ControllerMetrics()
    if config.server.metrics_port:
        metrics.serve(config.server.metrics_port)
        log.info("Prometheus metrics on :%d/metrics", config.server.metrics_port)

    ctx = zmq.asyncio.Context()
    curve = None
    if config.server.curve_secret_key_file:
        curve = CurveServerKeys(
            config.server.curve_secret_key_file, config.server.curve_client_keys_dir
        )
    channel = ControlChannel(ctx, config.server.control_addr, curve)
    cluster_mode = bool(config.server.etcd)
    dist_port = config.server.dist_port or (29500 if cluster_mode else free_tcp_port("127.0.0.1"))
    pipeline = PipelineExecutor(
        channel,
        config.parallel,
        # Cluster mode: workers started elsewhere must serve this model; local mode started them.
        model=model_name if cluster_mode else "",
        dist_host=config.server.dist_host or ("" if cluster_mode else "127.0.0.1"),
        dist_port=dist_port,
        socket_ifname=config.server.socket_ifname,
        heartbeat_timeout_s=config.server.heartbeat_timeout_s,
        new_dist_port=None if cluster_mode else lambda: free_tcp_port("127.0.0.1"),
    )
    membership: ControllerMembership | None = None
    engine_task: asyncio.Task[None] | None = None
    health_task: asyncio.Task[None] | None = None
    engine: Engine | None = None
    try:
        if cluster_mode:
            membership = ControllerMembership(config.server.etcd, config.server.cluster)
            control_port = channel.address.rsplit(":", 1)[1]
            await membership.start(
                stage_pb2.ControllerEndpoint(
                    control_addr=f"tcp://{config.server.advertise_host}:{control_port}",
                    grpc_addr=f"{config.server.advertise_host}:{port}",
                    model=model_name,
                    pp=config.parallel.pp,
                    tp=config.parallel.tp,
                )
            )

        def starting_with_refusal(reason: str) -> None:
            # Until the health watch runs, Status shows why the pipeline is not forming.
            if not pipeline.up:
                service.problem = f"the pipeline is not ready yet; {reason}"

        pipeline.on_refused = starting_with_refusal
        start = asyncio.create_task(pipeline.start(config.server.worker_start_timeout_s))
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if start not in done:
            start.cancel()
            return
        num_blocks = start.result()
        stopped.cancel()
        cache = CacheConfig(
            block_size=config.cache.block_size,
            num_blocks=num_blocks,
            watermark=config.cache.watermark,
        )
        scheduler = Scheduler(config.scheduler, cache)
        engine = Engine(scheduler, pipeline, make_text_stream, metrics, admission=config.admission)
        pipeline.on_down = lambda reason: log.warning(
            "%d requests requeued for recompute", engine.on_pipeline_down() if engine else 0
        )
        pipeline.on_up = engine.on_pipeline_up
        await pipeline.begin_serving(num_blocks, cache.block_size, engine.on_result)
        limits = RequestLimits(
            vocab_size=vocab_size,
            default_max_tokens=config.server.default_max_tokens,
            max_stop_strings=config.server.max_stop_strings,
            max_stop_string_chars=config.server.max_stop_string_chars,
            eos_token_ids=frozenset(tokenizer.eos_token_ids),
        )
        service.attach(engine, pipeline, limits, tokenizer.encode_prompt)
        http_state.attach(engine, limits, tokenizer)
        http_state.queue_full = engine.queue_full
        engine_task = asyncio.create_task(engine.run(), name="engine")

        def publish(problem: str) -> None:
            service.problem = problem
            mark_serving(health, serving=not problem)

        health_task = asyncio.create_task(
            watch_health(engine, pipeline, config.server.stall_timeout_s, publish), name="health"
        )
        log.info(
            "serving %s: pp=%d tp=%d, %d KV blocks of %d tokens, policy %s, budget %d",
            model_name, config.parallel.pp, config.parallel.tp, num_blocks, cache.block_size,
            config.scheduler.policy, config.scheduler.budget_tokens,
        )  # fmt: skip
        await stop.wait()
    finally:
        log.info("shutting down")
        service.shutting_down = True
        if engine is not None:  # open streams end with UNAVAILABLE, not a cut connection
            for request_id in engine.running_request_ids():
                engine.abort(request_id)
            await asyncio.sleep(0.05)
        if health_task is not None:
            health_task.cancel()
        if http_server is not None:
            await http_server.stop()
        await server.stop(grace=1.0)
        await pipeline.shutdown()
        if membership is not None:
            await membership.close()
        if engine_task is not None:
            engine_task.cancel()
        channel.close()
        ctx.term()
