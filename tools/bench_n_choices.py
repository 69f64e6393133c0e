"""n choices of one request against n separate requests, on a live local cluster.

A request with n > 1 computes its prompt once and shares the prompt's KV blocks; n separate
requests (choice i's seed each, so the outputs are the same) compute it n times. Both run on the
same cluster, alternating, and the outputs are compared, as are those of the separate requests
run one at a time (float rounding differs with the batch mix, and can change a sampled token):

    .venv/bin/python tools/bench_n_choices.py --model .cache/models/smollm2-135m-instruct

Prints each repeat and the medians: wall time until every choice ended, and time to each
choice's first token.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import grpc
from sarathi_proto import generate_pb2, generate_pb2_grpc
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig

Stub = generate_pb2_grpc.GenerationStub
Result = tuple[list[list[int]], float, list[float]]
"""Each choice's tokens, the wall time until all ended (s), each choice's TTFT (s)."""


async def _stream(
    stub: Stub, request: generate_pb2.GenerateRequest, start: float
) -> tuple[dict[int, list[int]], dict[int, float]]:
    """Token ids and time to first token (s), by choice index."""
    tokens: dict[int, list[int]] = {}
    ttft_s: dict[int, float] = {}
    async for response in stub.Generate(request, timeout=600):
        ttft_s.setdefault(response.index, time.perf_counter() - start)
        tokens.setdefault(response.index, []).extend(response.token_ids)
    return tokens, ttft_s


def _request(
    prompt: list[int], args: argparse.Namespace, n: int, seed: int
) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        n=n,
        sampling=generate_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=seed),
    )


async def one_request(stub: Stub, prompt: list[int], args: argparse.Namespace, seed: int) -> Result:
    start = time.perf_counter()
    tokens, ttft = await _stream(stub, _request(prompt, args, args.n, seed), start)
    wall = time.perf_counter() - start
    return [tokens[i] for i in range(args.n)], wall, [ttft[i] for i in range(args.n)]


async def separate_requests(
    stub: Stub, prompt: list[int], args: argparse.Namespace, seed: int
) -> Result:
    start = time.perf_counter()
    runs = await asyncio.gather(
        *(_stream(stub, _request(prompt, args, 1, seed + i), start) for i in range(args.n))
    )
    wall = time.perf_counter() - start
    return [tokens[0] for tokens, _ in runs], wall, [ttft[0] for _, ttft in runs]


async def one_by_one(stub: Stub, prompt: list[int], args: argparse.Namespace, seed: int) -> Result:
    """The separate requests again, one at a time: the same tokens but other batch mixes, for
    how often float rounding alone (a different mix) changes a sampled token."""
    start = time.perf_counter()
    runs = [await _stream(stub, _request(prompt, args, 1, seed + i), start) for i in range(args.n)]
    return [tokens[0] for tokens, _ in runs], time.perf_counter() - start, []


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


async def run(addr: str, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        shared: list[float] = []
        alone: list[float] = []
        shared_ttft: list[float] = []
        alone_ttft: list[float] = []
        differences: dict[str, list[int]] = {"in one request": [], "one at a time": []}
        for repeat in range(args.repeats):
            prompt = [rng.randrange(100, 40_000) for _ in range(args.prompt_tokens)]
            seed = rng.randrange(2**32)
            order = [one_request, separate_requests]
            if repeat % 2:
                order.reverse()
            results: dict[object, Result] = {}
            for run_one in order:
                results[run_one] = await run_one(stub, prompt, args, seed)
            (tok_n, wall_n, ttft_n), (tok_1, wall_1, ttft_1) = (
                results[one_request],
                results[separate_requests],
            )
            tok_seq = (await one_by_one(stub, prompt, args, seed))[0]
            for what, other in (("in one request", tok_n), ("one at a time", tok_seq)):
                for i, (a, b) in enumerate(zip(other, tok_1, strict=True)):
                    at = _first_difference(a, b)
                    if at is not None:
                        differences[what].append(at)
                        print(f"  choice {i} {what} differs from token {at} on", flush=True)
            shared.append(wall_n)
            alone.append(wall_1)
            shared_ttft += ttft_n
            alone_ttft += ttft_1
            print(
                f"repeat {repeat + 1}/{args.repeats}: n={args.n} in one request {wall_n:.2f} s, "
                f"as {args.n} requests {wall_1:.2f} s",
                flush=True,
            )
    med = statistics.median
    total = args.n * args.repeats
    for what, ats in differences.items():
        print(
            f"choices {what} equal to the concurrent n = 1 requests: {total - len(ats)} of "
            f"{total} (the others from token {sorted(ats)} on)"
        )
    print(
        f"\nmedian over {args.repeats}: one request {med(shared):.2f} s, separate "
        f"{med(alone):.2f} s, ratio {med(alone) / med(shared):.2f}x; median TTFT per choice "
        f"{med(shared_ttft) * 1e3:.0f} ms against {med(alone_ttft) * 1e3:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--n", type=int, default=4, help="choices (default 4)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (512)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per choice (32)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats (5)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (2)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and seeds (0)")
    args = parser.parse_args()
    config = LocalClusterConfig(model_dir=args.model, pp=args.pp, port=0, budget_tokens=256)
    with LocalCluster(config) as cluster:
        asyncio.run(run(cluster.addr, args))


if __name__ == "__main__":
    main()
