"""Load against a live cluster: replays a workload over gRPC with its arrival times.

Every request uses `ignore_eos` with `max_tokens` = the trace's output length, so the output
length does not depend on the weights. Token times are taken where a user sees them (on the
client); the scheduling delay comes from the server's last message; stage utilization from the
stages' own busy seconds (Status before and after the run, and at the two edges of the middle 80%
of the arrivals for the steady-state bubble).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field, replace

import grpc
import numpy as np
from sarathi_proto import generate_pb2, generate_pb2_grpc

from controller.executor.simulated import SimRequest, steady_window
from sarathictl.bench.metrics import BusyWindow, ServingMetrics, serving_metrics
from sarathictl.bench.probe_verdict import (
    InFlight,
    ProbeBounds,
    certain_miss,
    unscheduled_waits,
)

# Random prompt ids are drawn below this so that any model's vocabulary holds them.
PROMPT_ID_LIMIT = 200


@dataclass
class LiveRecord:
    arrival_s: float
    """When the request was sent, from the run's start (NaN: not yet)."""
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    scheduling_delay_s: float = float("nan")
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)
    last_token_s: float = float("nan")
    tokens_seen: int = 0
    """Tokens received so far (a message may carry several)."""
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
    stop_reason: str = ""
    """Why the run was stopped before its last request ended (probe_verdict.py); '' if not."""

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
            stopped_early=bool(self.num_errors or self.stop_reason),
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
    addr: str,
    requests: list[SimRequest],
    seed: int = 0,
    timeout_s: float = 600.0,
    bounds: ProbeBounds | None = None,
) -> LiveRun:
    """Sends every request at its arrival time (seconds from the start) and waits for all. With
    `bounds`, a probe of a capacity search: once it can no longer meet them (probe_verdict.py)
    the requests left are cancelled, and the run ends when the controller has let them go."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, PROMPT_ID_LIMIT, r.num_prompt_tokens).tolist() for r in requests]
    records = [LiveRecord(arrival_s=math.nan) for _ in requests]
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        before = await read_status(stub)
        start = time.perf_counter()
        lo, hi = steady_window([r.arrival_s for r in requests])
        # Status at the two edges of the steady window, read while the requests run.
        edges = asyncio.gather(_status_at(stub, start + lo), _status_at(stub, start + hi))
        sends = asyncio.gather(
            *(
                _send_at_arrival(stub, r, p, record, start, timeout_s)
                for r, p, record in zip(requests, prompts, records, strict=True)
            )
        )
        stop_reason = ""
        if bounds is not None:
            stop_reason = await _watch(stub, sends, requests, records, start, bounds)
        try:
            await sends
        except asyncio.CancelledError:
            if not stop_reason:
                raise
        end = time.perf_counter()
        steady = None
        if stop_reason:
            edges.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await edges
            _mark_cancelled(records)
            await _wait_until_drained(stub)
        else:
            at_lo, at_hi = await edges
            steady = BusyWindow(lo, hi, tuple(busy_between(at_lo, at_hi))) if hi > lo else None
        after = await read_status(stub)
    run = _live_run(records, end - start, before, after, steady)
    run.stop_reason = stop_reason
    return run


async def _watch(
    stub: generate_pb2_grpc.GenerationStub,
    sends: asyncio.Future[list[None]],
    requests: list[SimRequest],
    records: list[LiveRecord],
    start_s: float,
    bounds: ProbeBounds,
) -> str:
    """Polls the controller's count of unscheduled requests until the sends end, or until the
    probe's miss is certain: then cancels the sends and says why."""
    total_gaps = sum(max(0, r.num_output_tokens - 1) for r in requests)
    waited = [0.0] * len(requests)  # the longest each was seen unscheduled
    while not sends.done():
        await asyncio.wait({sends}, timeout=bounds.poll_s)
        if sends.done():
            break
        status = (await read_status(stub)).scheduler
        now = time.perf_counter() - start_s
        in_flight = [
            _in_flight(record, r.num_output_tokens, bounds.tbt_slo_s)
            for r, record in zip(requests, records, strict=True)
        ]
        seen = unscheduled_waits(in_flight, now, status.num_unscheduled)
        waited = [max(a, b) for a, b in zip(waited, seen, strict=True)]
        in_flight = [replace(r, waited_s=w) for r, w in zip(in_flight, waited, strict=True)]
        why = certain_miss(in_flight, now, bounds.tbt_slo_s, total_gaps, bounds.max_median_delay_s)
        if why:
            sends.cancel()
            return why
    return ""


def _in_flight(record: LiveRecord, max_tokens: int, tbt_slo_s: float) -> InFlight:
    return InFlight(
        sent_s=record.arrival_s,
        last_token_s=record.last_token_s,
        finished=not math.isnan(record.finish_s),
        delay_s=record.scheduling_delay_s,
        gaps_over_slo=sum(1 for g in record.gaps_s if g > tbt_slo_s),
        tokens_left=max_tokens - record.tokens_seen,
    )


def _mark_cancelled(records: list[LiveRecord]) -> None:
    """Records of the requests a stopped probe cancelled: errors, left out of its metrics."""
    for record in records:
        if math.isnan(record.finish_s) and not record.error:
            record.error = "CANCELLED: the probe stopped once its miss was certain"


async def _wait_until_drained(
    stub: generate_pb2_grpc.GenerationStub, timeout_s: float = 60.0, poll_s: float = 0.2
) -> None:
    """Until the controller holds no request (a cancelled call aborts its request there), so
    that the next probe starts on an empty cluster."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        status = (await read_status(stub)).scheduler
        if status.num_waiting == 0 and status.num_running == 0:
            return
        await asyncio.sleep(poll_s)
    raise TimeoutError(f"the cluster still held requests {timeout_s:g} s after a probe stopped")


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
    record: LiveRecord,
    start_s: float,
    timeout_s: float,
) -> None:
    """Sends one request at start_s + its arrival (time.perf_counter() seconds) and records, in
    seconds from start_s, when it went and when its tokens came; a failed call is recorded as
    its gRPC status, not raised."""
    clock = time.perf_counter
    await asyncio.sleep(max(0.0, start_s + req.arrival_s - clock()))
    record.arrival_s = clock() - start_s
    record.num_prompt_tokens = len(prompt)
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=req.num_output_tokens, ignore_eos=True
    )
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            now = clock() - start_s
            if response.token_ids:
                if math.isnan(record.last_token_s):
                    record.first_token_s = now
                else:
                    record.gaps_s.append(now - record.last_token_s)
                record.last_token_s = now
                record.tokens_seen += len(response.token_ids)
            if response.finish_reason:
                record.finish_s = now
                record.scheduling_delay_s = response.scheduling_delay_s
                record.num_output_tokens = response.num_output_tokens
    except grpc.aio.AioRpcError as err:
        record.error = f"{err.code().name}: {err.details()}"


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
