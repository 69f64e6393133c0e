"""Sampled streams with and without prefix-cache hits, on real stage workers (tiny random Llama).

A draw depends on the request's seed and the token's position alone, so a hit should not change
a stream; a hit does shorten the prefill (other chunks, other batches), and a coarse dtype rounds
the logits of another batch shape differently. This counts the streams that differ, beside a
control that changes only the token budget with the cache off (RELIABILITY.md, Prefix caching):

    .venv/bin/python tools/bench_prefix_sampling.py --dtypes float32,bfloat16 --pp 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' pipeline driver

from controller.scheduler import RequestParams, SamplingParams
from tests.integration.stage_worker.pipeline_driver import LocalPipeline
from tests.unit.stage_worker.tiny_models import VOCAB_SIZE, make_checkpoint

BASE = [(7 * j + 3) % VOCAB_SIZE for j in range(64)]  # the shared prefix: 4 blocks of 16


def prompts(num: int) -> list[list[int]]:
    """BASE's first 16 to 64 tokens, then up to 6 of each request's own."""
    return [
        BASE[: 16 + i % 49] + [(13 * i + j) % VOCAB_SIZE for j in range(i % 7)] for i in range(num)
    ]


def differing(a: dict[int, list[int]], b: dict[int, list[int]], offset: int) -> int:
    return sum(1 for i, tokens in a.items() if tokens != b[offset + i])


def measure(model_dir: Path, dtype: str, pp: int, num: int, max_tokens: int) -> str:
    params = [
        RequestParams(max_tokens, sampling=SamplingParams(temperature=1.0, seed=1000 + i))
        for i in range(num)
    ]
    asked = prompts(num)
    with LocalPipeline(model_dir, pp, 1, dtype=dtype, block_size=16) as pipe:
        plain = pipe.generate(asked, 0, params=params, scheduler=pipe.make_scheduler(32, 8, False))
        other = pipe.make_scheduler(64, 8, False)
        control = pipe.generate(asked, 0, params=params, scheduler=other, first_seq_id=30_000)
        cached = pipe.make_scheduler()
        pipe.generate([BASE], 2, scheduler=cached, first_seq_id=10_000)
        hits = pipe.generate(asked, 0, params=params, scheduler=cached, first_seq_id=20_000)
    stats = cached.prefix_cache.stats
    return (
        f"{dtype} PP {pp}: {num} sampled streams of {max_tokens} tokens, "
        f"{stats.num_hit_requests} with a hit ({stats.num_cached_tokens} cached tokens); "
        f"streams that differ with hits: {differing(plain.tokens, hits.tokens, 20_000)}; "
        f"control (no cache, budget 64 for 32): {differing(plain.tokens, control.tokens, 30_000)}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated worker dtypes")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--num", type=int, default=48, help="sampled requests")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per stream")
    args = p.parse_args()
    model_dir = make_checkpoint("llama", Path(tempfile.mkdtemp()))
    for dtype in args.dtypes.split(","):
        print(measure(model_dir, dtype, args.pp, args.num, args.max_tokens))


if __name__ == "__main__":
    main()
