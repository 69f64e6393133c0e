"""Time to first token with a shared system prompt, prefix cache on and off, on a live local
cluster (one after the other on the same machine):

    .venv/bin/python tools/bench_prefix_ttft.py --model .cache/models/smollm2-135m-instruct

Each request is the same system prompt (--system-tokens random ids, drawn once) and a question
of its own (--question-tokens), sent one at a time, so TTFT is the prefill alone. The first
request of each run computes the system prompt either way and is left out. Prints, per setting,
the median TTFT and the server's own prefix-cache counts.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import grpc
from sarathi_proto import generate_pb2, generate_pb2_grpc
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig


def ttft_s(stub: generate_pb2_grpc.GenerationStub, prompt: list[int], max_tokens: int) -> float:
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True
    )
    start = time.perf_counter()
    first = None
    for _ in stub.Generate(request, timeout=600):
        first = first or time.perf_counter() - start
    assert first is not None
    return first


def run(config: LocalClusterConfig, prompts: list[list[int]], max_tokens: int) -> str:
    with LocalCluster(config) as cluster, grpc.insecure_channel(cluster.addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        times = [ttft_s(stub, prompt, max_tokens) for prompt in prompts]
        pc = stub.Status(generate_pb2.StatusRequest(), timeout=10).scheduler.prefix_cache
    after_first = times[1:]
    return (
        f"prefix cache {'on ' if config.prefix_caching else 'off'}: median TTFT "
        f"{statistics.median(after_first) * 1e3:.0f} ms over {len(after_first)} requests "
        f"(first: {times[0] * 1e3:.0f} ms); hits {pc.num_hit_requests}/{pc.num_requests}, "
        f"{pc.num_cached_tokens}/{pc.num_prompt_tokens} tokens from the cache"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--system-tokens", type=int, default=512, help="shared prefix (512)")
    parser.add_argument("--question-tokens", type=int, default=32, help="own tokens (32)")
    parser.add_argument("--requests", type=int, default=9, help="per setting (9)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per request (4)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (2)")
    parser.add_argument("--budget", type=int, default=128, help="token budget (128)")
    args = parser.parse_args()
    rng = random.Random(0)
    system = [rng.randrange(100, 40_000) for _ in range(args.system_tokens)]
    prompts = [
        system + [rng.randrange(100, 40_000) for _ in range(args.question_tokens)]
        for _ in range(args.requests)
    ]
    for caching in (True, False):
        config = LocalClusterConfig(
            model_dir=args.model,
            pp=args.pp,
            port=0,
            budget_tokens=args.budget,
            prefix_caching=caching,
        )
        print(run(config, prompts, args.max_tokens), flush=True)


if __name__ == "__main__":
    main()
