"""Load against a live cluster: replays a workload over gRPC with its arrival times.

Every request uses `ignore_eos` with `max_tokens` = the trace's output length, so the output
length does not depend on the weights. Token times are taken where a user sees them (on the
client); the scheduling delay comes from the server's last message; stage utilization from the
stages' own busy seconds (Status before and after the run, and at the two edges of the middle 80%
of the arrivals for the steady-state bubble).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
from sarathi_proto import generate_pb2, generate_pb2_grpc

from controller.executor.simulated import SimRequest, steady_window
from sarathictl.bench.metrics import BusyWindow, ServingMetrics, serving_metrics

# Random prompt ids are drawn below this so that any model's vocabulary holds them.
PROMPT_ID_LIMIT = 200


@dataclass
class LiveRecord:
    arrival_s: float
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    scheduling_delay_s: float = float("nan")
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class LiveRun:
    records: list[LiveRecord]
    start_s: float
    end_s: float
    stage_busy_s: list[float]
    num_preemptions: int
    num_steps: int = 0
    """Micro-batches the controller issued during the run."""
    controller_busy_s: float = 0.0
    """Controller CPU time spent scheduling, encoding, sending and applying results in the run."""
    steady: BusyWindow | None = None
    """Stage busy seconds over the middle 80% of the arrivals."""

    @property
    def controller_share_of_step(self) -> float:
        """Controller time per micro-batch over the mean stage's busy time per micro-batch."""
        if not self.num_steps or not self.stage_busy_s:
            return float("nan")
        stage_step_s = sum(self.stage_busy_s) / len(self.stage_busy_s) / self.num_steps
        return (self.controller_busy_s / self.num_steps) / stage_step_s

    @property
    def num_errors(self) -> int:
        return sum(1 for r in self.records if r.error)

    def metrics(self) -> ServingMetrics:
        ok = [r for r in self.records if not r.error]
        return serving_metrics(
            ttft_s=np.array([r.first_token_s - r.arrival_s for r in ok]),
            scheduling_delay_s=np.array([r.scheduling_delay_s for r in ok]),
            tbt_gaps_s=np.array([g for r in ok for g in r.gaps_s]),
            probe=BusyWindow(self.start_s, self.end_s, tuple(self.stage_busy_s)),
            request_spans_s=[(r.arrival_s, r.finish_s) for r in ok],
            num_tokens=sum(r.num_prompt_tokens + r.num_output_tokens for r in ok),
            num_preemptions=self.num_preemptions,
            stopped_early=bool(self.num_errors),
            steady=self.steady,
        )


async def read_status(stub: generate_pb2_grpc.GenerationStub) -> generate_pb2.StatusResponse:
    response: generate_pb2.StatusResponse = await stub.Status(
        generate_pb2.StatusRequest(), timeout=10
    )
    return response


def busy_between(
    before: generate_pb2.StatusResponse, after: generate_pb2.StatusResponse
) -> list[float]:
    return [
        a.busy_s_total - b.busy_s_total for a, b in zip(after.stages, before.stages, strict=True)
    ]


async def replay(
    addr: str, requests: list[SimRequest], seed: int = 0, timeout_s: float = 600.0
) -> LiveRun:
    """Sends every request at its arrival time (seconds from the start) and waits for all."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, PROMPT_ID_LIMIT, r.num_prompt_tokens).tolist() for r in requests]
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        before = await read_status(stub)
        start = time.perf_counter()
        lo, hi = steady_window([r.arrival_s for r in requests])
        # Status at the two edges of the steady window, read while the requests run.
        edges = asyncio.gather(_status_at(stub, start + lo), _status_at(stub, start + hi))
        records = await asyncio.gather(
            *(
                _send_at_arrival(stub, r, p, start, timeout_s)
                for r, p in zip(requests, prompts, strict=True)
            )
        )
        end = time.perf_counter()
        after = await read_status(stub)
        at_lo, at_hi = await edges
    steady = BusyWindow(lo, hi, tuple(busy_between(at_lo, at_hi))) if hi > lo else None
    return _live_run(list(records), end - start, before, after, steady)


async def _status_at(
    stub: generate_pb2_grpc.GenerationStub, at_s: float
) -> generate_pb2.StatusResponse:
    """Status once time.perf_counter() reaches at_s (at once if it has)."""
    await asyncio.sleep(max(0.0, at_s - time.perf_counter()))
    return await read_status(stub)


async def _send_at_arrival(
    stub: generate_pb2_grpc.GenerationStub,
    req: SimRequest,
    prompt: list[int],
    start_s: float,
    timeout_s: float,
) -> LiveRecord:
    """Sends one request at start_s + its arrival (time.perf_counter() seconds) and records, in
    seconds from start_s, when it went and when its tokens came; a failed call is recorded as
    its gRPC status, not raised."""
    clock = time.perf_counter
    await asyncio.sleep(max(0.0, start_s + req.arrival_s - clock()))
    record = LiveRecord(arrival_s=clock() - start_s, num_prompt_tokens=len(prompt))
    last = None
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=req.num_output_tokens, ignore_eos=True
    )
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            now = clock() - start_s
            if response.token_ids:
                if last is None:
                    record.first_token_s = now
                else:
                    record.gaps_s.append(now - last)
                last = now
            if response.finish_reason:
                record.finish_s = now
                record.scheduling_delay_s = response.scheduling_delay_s
                record.num_output_tokens = response.num_output_tokens
    except grpc.aio.AioRpcError as err:
        record.error = f"{err.code().name}: {err.details()}"
    return record


def _live_run(
    records: list[LiveRecord],
    duration_s: float,
    before: generate_pb2.StatusResponse,
    after: generate_pb2.StatusResponse,
    steady: BusyWindow | None,
) -> LiveRun:
    """The run from its records and the server's counters before and after it: stage busy
    seconds, preemptions, micro-batches and controller seconds spent in the run."""
    return LiveRun(
        records,
        0.0,
        duration_s,
        busy_between(before, after),
        after.scheduler.num_preemptions - before.scheduler.num_preemptions,
        num_steps=after.scheduler.num_steps - before.scheduler.num_steps,
        controller_busy_s=(
            after.scheduler.controller_busy_s_total - before.scheduler.controller_busy_s_total
        ),
        steady=steady,
    )


def scale_requests(requests: list[SimRequest], scale: float, max_total: int) -> list[SimRequest]:
    """Shrinks a trace's lengths by `scale` (at least one token each) to fit a small model."""
    scaled = []
    for r in requests:
        prompt = max(1, round(r.num_prompt_tokens * scale))
        output = max(1, round(r.num_output_tokens * scale))
        if max_total and prompt + output > max_total:
            prompt = max(1, max_total - output)
        scaled.append(SimRequest(r.arrival_s, prompt, output))
    return scaled
