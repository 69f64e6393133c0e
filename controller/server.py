"""The public gRPC API (grpc.aio): Generate, Abort, Status, plus standard health and reflection."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sarathi_proto import generate_pb2, generate_pb2_grpc

from controller.admission import AdmissionError, QueueFullError
from controller.api_request import PromptEncoder, RequestLimits, grpc_tools, to_generation_request
from controller.bind_error import BindError
from controller.engine import Engine
from controller.grpc_stream import RequestFailed, ShuttingDown, responses
from controller.scheduler import InvalidRequestError, Scheduler
from controller.security import BearerTokenInterceptor
from controller.stage_report import public_phases, stage_shares
from controller.telemetry import percentile

if TYPE_CHECKING:
    from controller.executor.pipeline import PipelineExecutor

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationService(generate_pb2_grpc.GenerationServicer):
    """Serves the API; until the pipeline is up, Generate answers UNAVAILABLE."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: Engine | None = None
        self.pipeline: PipelineExecutor | None = None
        self.limits: RequestLimits | None = None
        self.encode: PromptEncoder | None = None
        self.started_at = time.monotonic()
        self.problem = "the pipeline is not ready yet"
        """Why the controller is not serving (set by the health watch); empty while serving."""
        self.shutting_down = False

    def attach(
        self,
        engine: Engine,
        pipeline: PipelineExecutor,
        limits: RequestLimits,
        encode: PromptEncoder,
    ) -> None:
        self.engine, self.pipeline, self.limits, self.encode = engine, pipeline, limits, encode

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        engine = self.engine
        if engine is None or self.limits is None or self.encode is None:
            # Not ready, or a standby controller: the problem says which.
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, self.problem or "the pipeline is not ready yet"
            )
            return
        if self.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the controller is shutting down")
            return
        try:
            tools = grpc_tools(request)
            generation = to_generation_request(request, self.limits, self.encode, tools)
            handle = engine.add(generation)
        except AdmissionError as err:
            # The retry hint, in seconds, as HTTP's Retry-After; also in the message for people.
            context.set_trailing_metadata((("retry-after", f"{err.retry_after_s:g}"),))
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if isinstance(err, QueueFullError)
                else grpc.StatusCode.UNAVAILABLE
            )
            await context.abort(code, str(err))
            return
        except InvalidRequestError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            return
        except ValueError as err:  # a request id that is already running
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(err))
            return
        try:
            async for response in responses(handle, generation, tools, lambda: self.shutting_down):
                yield response
        except ShuttingDown:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the controller is shutting down; retry"
            )
        except RequestFailed as err:
            await context.abort(grpc.StatusCode.INTERNAL, str(err))
        finally:
            # A cancelled call or a passed deadline lands here: free the sequences everywhere.
            if not handle.finished:
                engine.abort(handle.request_id)

    async def Abort(
        self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.AbortResponse:
        found = self.engine is not None and self.engine.abort(request.request_id)
        return generate_pb2.AbortResponse(found=found)

    async def Status(
        self, request: generate_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.StatusResponse:
        return build_status(self)


def prefix_cache_status(sched: Scheduler) -> generate_pb2.PrefixCacheStatus:
    stats = sched.prefix_cache.stats
    return generate_pb2.PrefixCacheStatus(
        enabled=sched.prefix_cache.enabled,
        num_requests=stats.num_requests,
        num_hit_requests=stats.num_hit_requests,
        num_prompt_tokens=stats.num_prompt_tokens,
        num_cached_tokens=stats.num_cached_tokens,
        num_cached_blocks=sched.block_manager.num_cached_blocks,
        num_evictions=sched.block_manager.num_evictions,
    )


def build_status(service: GenerationService) -> generate_pb2.StatusResponse:
    now = time.monotonic()
    status = generate_pb2.StatusResponse(
        model=service.model_name,
        uptime_s=now - service.started_at,
        serving=not service.problem,
        problem=service.problem,
    )
    engine, pipeline = service.engine, service.pipeline
    if engine is None or pipeline is None:
        return status
    status.scheduler.CopyFrom(scheduler_status(engine, pipeline))
    add_stage_statuses(status, service.problem, engine, pipeline, now)
    ttft, tbt = engine.latency.ttft(now), engine.latency.tbt(now)
    status.latency.CopyFrom(
        generate_pb2.LatencyStatus(
            ttft_p50_s=percentile(ttft, 0.5),
            ttft_p99_s=percentile(ttft, 0.99),
            tbt_p50_s=percentile(tbt, 0.5),
            tbt_p99_s=percentile(tbt, 0.99),
        )
    )
    status.throughput_tokens_per_s = engine.latency.tokens_per_s(now, since=pipeline.started_at)
    for name, total in engine.phases.totals().items():
        setattr(status.controller_phases, name, total)
    return status


def scheduler_status(engine: Engine, pipeline: PipelineExecutor) -> generate_pb2.SchedulerStatus:
    sched = engine.scheduler
    return generate_pb2.SchedulerStatus(
        policy=sched.config.policy,
        budget_tokens=sched.config.budget_tokens,
        idle_budget_tokens=sched.config.idle_budget_tokens,
        num_waiting=sched.num_waiting,
        num_running=sched.num_running,
        num_unscheduled=sched.num_unscheduled,
        kv_usage_pct=100.0 * sched.kv_usage,
        num_preemptions=sched.num_preemptions,
        pipeline_depth=pipeline.parallel.pp,
        tensor_parallel=pipeline.parallel.tp,
        num_steps=engine.num_steps,
        controller_busy_s_total=engine.overhead_s,
        max_num_seqs=sched.config.max_num_seqs,
        time_budget_s=sched.config.time_budget_s,
        tbt_slo_s=sched.config.tbt_slo_s,
        prefix_cache=prefix_cache_status(sched),
        num_suspects=len(sched.quarantine.suspects),
        num_quarantined=sched.quarantine.num_convicted,
    )


def add_stage_statuses(
    status: generate_pb2.StatusResponse,
    problem: str,
    engine: Engine,
    pipeline: PipelineExecutor,
    now: float,
) -> None:
    """One StageStatus per stage, in order; `problem` names a stall, whose stage is marked."""
    stalled_stage = pipeline.lagging_stage() if "no step completed" in problem else None
    preparing_stages = {w.stage for w in pipeline.preparing_cache()}
    for stage, shares in zip(pipeline.stages, stage_shares(engine, pipeline, now), strict=True):
        status.stages.add(
            stage=stage.stage,
            host=stage.host,
            device=stage.device,
            tp_ranks=sorted(stage.tp_ranks),
            utilization_pct=100.0 * shares.utilization,
            bubble_pct=100.0 * shares.bubble,
            idle_pct=100.0 * shares.idle,
            step_time_p50_s=stage.step_time_p50_s(),
            micro_batches_in_flight=pipeline.inflight_on_stage(stage.stage),
            up=pipeline.up or len(stage.tp_ranks) == pipeline.parallel.tp,
            busy_s_total=stage.busy_s_total,
            heartbeat_age_s=pipeline.heartbeat_age_s(stage.stage, now),
            stalled=stage.stage == stalled_stage,
            preparing_cache=stage.stage in preparing_stages,
            phases=public_phases(stage.phases),
        )


async def start_grpc_server(
    service: GenerationService,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
    tokens: frozenset[str] = frozenset(),
) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Starts serving. Health has two names: SERVICE_NAME, the API (readiness), NOT_SERVING
    until mark_serving; and "", the process (startup and liveness probes), SERVING while it
    lives, standby included, until mark_alive(False) for a stall. Returns the bound port. With
    credentials the port speaks only TLS; with tokens every call but health must carry one."""
    interceptors = [BearerTokenInterceptor(tokens)] if tokens else []
    # gRPC sets SO_REUSEPORT by default: a second controller on a port in use would bind it
    # too, and the kernel would share the calls between the two.
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
    generate_pb2_grpc.add_GenerationServicer_to_server(service, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{host}:{port}"
    try:
        if credentials is not None:
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind"; older versions returned 0
        bound = 0
    if bound == 0:
        raise BindError(f"cannot bind the gRPC API to {address}: is the port in use?")
    await server.start()
    return server, bound, health_servicer


def _status(up: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return (
        health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
    )


def mark_serving(health_servicer: health.HealthServicer, serving: bool = True) -> None:
    """The API's status (SERVICE_NAME): what readiness and clients wait for."""
    health_servicer.set(SERVICE_NAME, _status(serving))


def mark_alive(health_servicer: health.HealthServicer, alive: bool = True) -> None:
    """The process's status (""): what liveness restarts on."""
    health_servicer.set("", _status(alive))
