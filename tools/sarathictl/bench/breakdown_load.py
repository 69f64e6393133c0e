"""The load of `bench step-breakdown`: N requests decoding together over gRPC, optionally with
prompts arriving all the while (a mixed batch), and two Status readings taken while every one
of the N still decodes: the first once all are past a warm-up, the second a window of tokens
later. Every request uses `ignore_eos`, so no request ends early whatever the weights.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sarathi_proto import generate_pb2, generate_pb2_grpc

from sarathictl.bench.live_load import PROMPT_ID_LIMIT, read_status

TAIL_TOKENS = 4
"""Tokens each decoding request asks for beyond the window: with PP > 1 the decodes are spread
over the micro-batches in flight, a token apart, so none may finish before the second reading."""
REQUEST_TIMEOUT_S = 600.0
POLL_S = 0.002
clock = time.perf_counter


@dataclass(frozen=True)
class Scenario:
    label: str
    decodes: int
    """Requests decoding together."""
    prompt_tokens: int
    """Prompt length of each decoding request (short: their prefill is not what is measured)."""
    warmup_tokens: int
    """Tokens every decoding request has before the first reading."""
    window_tokens: int
    """Tokens every decoding request gets between the readings."""
    prefill_tokens: int = 0
    """A mixed batch: prompts of this many tokens keep arriving (0: decodes only)."""
    prefill_streams: int = 0
    """Prompts in flight at a time, each sent as soon as the one before it got its token."""

    def __post_init__(self) -> None:
        for name in ("decodes", "prompt_tokens", "warmup_tokens", "window_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.label}: {name}={getattr(self, name)}: must be >= 1")
        if self.prefill_tokens < 0 or self.prefill_streams < 0:
            raise ValueError(
                f"{self.label}: prefill_tokens={self.prefill_tokens}, prefill_streams="
                f"{self.prefill_streams}: must be >= 0"
            )
        if bool(self.prefill_tokens) != bool(self.prefill_streams):
            raise ValueError(f"{self.label}: prefill_tokens and prefill_streams: set both or none")

    def max_tokens_at(self, budget_tokens: int) -> int:
        """Each decoding request's max_tokens under a micro-batch budget of `budget_tokens`.
        The prompts are prefilled one after the other, so the first has decoded for as many
        micro-batches as the rest took to prefill before the last one has a token; without that
        head start, 4 prompts of 440 tokens at budget 64 ended the first before the window."""
        prefill_room = max(1, budget_tokens - self.decodes)  # prompt tokens a micro-batch at least
        head_start = -(-self.decodes * self.prompt_tokens // prefill_room) + self.decodes
        return head_start + self.warmup_tokens + self.window_tokens + TAIL_TOKENS


@dataclass(frozen=True)
class ScenarioReadings:
    before: generate_pb2.StatusResponse
    after: generate_pb2.StatusResponse
    client_tpot_s: float
    """Median over the decoding requests of their mean gap between tokens in the window."""


def prompt(rng: np.random.Generator, num_tokens: int) -> list[int]:
    return [int(t) for t in rng.integers(1, PROMPT_ID_LIMIT, num_tokens)]


async def stream_tokens(
    stub: generate_pb2_grpc.GenerationStub, ids: list[int], max_tokens: int, times: list[float]
) -> None:
    """One request; each token's arrival time is appended to `times`."""
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=ids, max_tokens=max_tokens, ignore_eos=True
    )
    async for response in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
        now = clock()
        times.extend([now] * len(response.token_ids))


async def _feed(
    stub: generate_pb2_grpc.GenerationStub, rng: np.random.Generator, num_tokens: int
) -> None:
    """New prompts one after the other, each to its first token, until cancelled: each drawn
    afresh, since the prefix cache would take a repeated one from its blocks, not compute it."""
    while True:
        await stream_tokens(stub, prompt(rng, num_tokens), 1, [])


async def _until(
    times: list[list[float]], tokens: int, tasks: Sequence[asyncio.Task[None]]
) -> None:
    """Until every decoding request has `tokens` tokens; raises RuntimeError when a request
    failed or ended first."""
    while min(len(t) for t in times) < tokens:
        for task in tasks:
            if task.done():
                error = task.exception()
                raise RuntimeError(
                    f"a request failed: {error}" if error else "a request ended before its window"
                )
        await asyncio.sleep(POLL_S)


def window_tpot_s(times: list[list[float]], start: float, end: float) -> float:
    """Median over the requests of their mean gap between tokens that arrived in [start, end];
    NaN when no request had two tokens there."""
    means = []
    for arrivals in times:
        inside = [t for t in arrivals if start <= t <= end]
        if len(inside) >= 2:
            means.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return statistics.median(means) if means else math.nan


async def run_scenario(
    stub: generate_pb2_grpc.GenerationStub,
    scenario: Scenario,
    rng: np.random.Generator,
    budget_tokens: int,
) -> ScenarioReadings:
    """Runs one scenario; every request it sent is cancelled (aborted) before it returns."""
    times: list[list[float]] = [[] for _ in range(scenario.decodes)]
    max_tokens = scenario.max_tokens_at(budget_tokens)
    tasks = [
        asyncio.create_task(
            stream_tokens(stub, prompt(rng, scenario.prompt_tokens), max_tokens, arrivals)
        )
        for arrivals in times
    ]
    try:
        await _until(times, 1, tasks)  # every prompt prefilled: from here on they decode
        tasks += [
            asyncio.create_task(_feed(stub, rng, scenario.prefill_tokens))
            for _ in range(scenario.prefill_streams)
        ]
        await _until(times, scenario.warmup_tokens, tasks)
        before, start = await read_status(stub), clock()
        await _until(times, scenario.warmup_tokens + scenario.window_tokens, tasks)
        end, after = clock(), await read_status(stub)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return ScenarioReadings(before, after, window_tpot_s(times, start, end))


async def warm_up(
    stub: generate_pb2_grpc.GenerationStub, scenarios: Sequence[Scenario], rng: np.random.Generator
) -> None:
    """A few tokens at the largest batch and one prompt of each mixed length, so that the first
    scenario does not measure the kernels' first calls."""
    largest = max(scenarios, key=lambda s: s.decodes)
    requests = [prompt(rng, largest.prompt_tokens) for _ in range(largest.decodes)]
    requests += [prompt(rng, s.prefill_tokens) for s in scenarios if s.prefill_tokens]
    await asyncio.gather(*(stream_tokens(stub, ids, 3, []) for ids in requests))


async def until_idle(stub: generate_pb2_grpc.GenerationStub, timeout_s: float = 60.0) -> None:
    """Until no request waits or runs (the cancelled ones are aborted at the next step)."""
    deadline = clock() + timeout_s
    while True:
        scheduler = (await read_status(stub)).scheduler
        if scheduler.num_running == 0 and scheduler.num_waiting == 0:
            return
        if clock() > deadline:
            raise TimeoutError(f"requests still running after {timeout_s:.0f} s")
        await asyncio.sleep(0.05)
