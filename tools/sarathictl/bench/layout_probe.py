"""What `sarathictl tune-layout` measures on one running layout in one round: a lone request
(its first token and its pace after it), then a burst of requests sent at once (its throughput).

The two stand for the two ends of a serving load: light load, where a request's TPOT is one
step of a lone decode, and saturation, where what counts is how many prompt and output tokens
the layout gets through. Every prompt is drawn afresh, so the prefix cache computes each one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
from sarathi_proto import generate_pb2_grpc

from sarathictl.bench.breakdown_load import prompt, stream_tokens, until_idle

clock = time.perf_counter


@dataclass(frozen=True)
class ProbeWorkload:
    requests: int
    """Requests in each burst."""
    prompt_tokens: int
    output_tokens: int

    def describe(self) -> str:
        return (
            f"a lone request and a burst of {self.requests} requests of {self.prompt_tokens} + "
            f"{self.output_tokens} tokens"
        )


@dataclass(frozen=True)
class ProbeResult:
    burst_requests_per_s: float
    """Requests over the seconds from sending them to the last one's last token."""
    lone_ttft_s: float
    lone_tpot_s: float


async def lone_request(
    stub: generate_pb2_grpc.GenerationStub, rng: np.random.Generator, workload: ProbeWorkload
) -> tuple[float, float]:
    """(TTFT, TPOT) of one request with nothing else running, seconds."""
    times: list[float] = []
    sent = clock()
    await stream_tokens(stub, prompt(rng, workload.prompt_tokens), workload.output_tokens, times)
    if len(times) < 2:
        raise RuntimeError(f"a lone request got {len(times)} token(s), not a TPOT")
    return times[0] - sent, (times[-1] - times[0]) / (len(times) - 1)


async def burst_requests_per_s(
    stub: generate_pb2_grpc.GenerationStub, rng: np.random.Generator, workload: ProbeWorkload
) -> float:
    """Sends every request of a burst at once; requests over the seconds to the last token."""
    requests = [prompt(rng, workload.prompt_tokens) for _ in range(workload.requests)]
    sent = clock()
    await asyncio.gather(
        *(stream_tokens(stub, ids, workload.output_tokens, []) for ids in requests)
    )
    return workload.requests / (clock() - sent)


async def probe(
    addr: str, workload: ProbeWorkload, seed: int, hear: Callable[[str], None] = lambda _: None
) -> ProbeResult:
    """A warm-up (a short burst, so that no kernel's first call is measured), the lone request,
    then the burst, one after the other with the cluster idle in between; `hear` gets a line
    after each. The same seed draws the same prompts."""
    rng = np.random.default_rng(seed)
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        warm = ProbeWorkload(min(2, workload.requests), workload.prompt_tokens, output_tokens=2)
        await burst_requests_per_s(stub, rng, warm)
        await until_idle(stub)
        ttft_s, tpot_s = await lone_request(stub, rng, workload)
        hear(f"alone: TTFT {ttft_s * 1e3:.0f} ms, TPOT {tpot_s * 1e3:.1f} ms")
        await until_idle(stub)
        rate = await burst_requests_per_s(stub, rng, workload)
        hear(f"burst of {workload.requests}: {rate:.3g} req/s")
    return ProbeResult(rate, ttft_s, tpot_s)
