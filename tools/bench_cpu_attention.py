"""Attention over a paged KV cache on this CPU: the package's C kernel (attention/cpu_kernel.py)
against the torch path it replaces, for decodes and for prompt chunks.

    python tools/bench_cpu_attention.py [--threads 2] [--points 1x256,4x512,32x256]
        [--chunks 48@168,48@336] [--layers 30] [--rounds 5] [--dtype bfloat16]

Heads are the demo model's (SmolLM2-135M: 9 query heads, 3 KV heads of 64), float32 (or
--dtype bfloat16, on the AVX-512 kernel), 16-token blocks in shuffled order. Each point runs
every layer's attention in turn over that layer's own caches, 30 layers by default as in the
model, so the caches come from memory as in a step and not from the last level cache. Prints
the median milliseconds over all layers, the two paths alternated in rounds so that a noisy
machine loads both alike, and for
- a decode point (BATCHxCONTEXT: that many sequences, one query token each): the KV bytes read
  over the kernel's time (GB/s); the torch path gathers every sequence's blocks, then batched
  products (paged_decode);
- a chunk point (TOKENS@POSITION: one sequence's prompt chunk of that many tokens after that
  many cached ones, each token attending its causal prefix): the kernel's nanoseconds per
  (query token, key row, KV head); the torch path gathers the sequence's blocks once, then SDPA
  with the causal mask, as the torch backend runs a chunk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stage_worker.attention import cpu_kernel
from stage_worker.attention.torch_backend import paged_decode

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
Paths = dict[str, Callable[[], None]]


def random_caches(
    blocks: int, layers: int, gen: torch.Generator, dtype: torch.dtype
) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's key and value caches of random values: [blocks, BLOCK_SIZE, KV_HEADS,
    HEAD_DIM] each (tools/ab_attention_builds.py takes them too)."""
    shape = (blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return [(torch.randn(shape, generator=gen).to(dtype),
             torch.randn(shape, generator=gen).to(dtype)) for _ in range(layers)]  # fmt: skip


def decode_paths(
    batch: int, context: int, layers: int, threads: int, dtype: torch.dtype = torch.float32
) -> Paths:
    """Per path, a closure attending one query token per sequence in every layer."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK_SIZE)
    caches = random_caches(batch * per_seq, layers, gen, dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    table = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int64)
    mask = (torch.arange(per_seq * BLOCK_SIZE) < context).expand(batch, 1, 1, -1)
    scratch = torch.empty(cpu_kernel.scratch_floats(HEADS, KV_HEADS, context, threads))
    flat = table.flatten()

    def kernel() -> None:
        for k, v in caches:
            cpu_kernel.attend(q, k, v, table, lens, scratch, threads)

    def torch_path() -> None:
        for k, v in caches:
            paged_decode(q, k, v, flat, per_seq * BLOCK_SIZE, mask)

    return {"C kernel": kernel, "torch path": torch_path}


def chunk_paths(
    tokens: int, position: int, layers: int, threads: int, dtype: torch.dtype = torch.float32
) -> Paths:
    """Per path, a closure attending one sequence's prompt chunk in every layer."""
    gen = torch.Generator().manual_seed(0)
    context = position + tokens
    per_seq = -(-context // BLOCK_SIZE)
    caches = random_caches(per_seq, layers, gen, dtype)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    row = torch.randperm(per_seq, generator=gen)
    table = row.expand(tokens, -1).contiguous()  # every token of the chunk: its sequence's table
    lens = torch.arange(position + 1, context + 1, dtype=torch.int64)
    scratch = torch.empty(cpu_kernel.scratch_floats(HEADS, KV_HEADS, context, threads))
    causal = torch.arange(context)[None, :] < lens[:, None]  # [tokens, context]
    group = HEADS // KV_HEADS

    def kernel() -> None:
        for k, v in caches:
            cpu_kernel.attend(q, k, v, table, lens, scratch, threads)

    def torch_path() -> None:
        for k_cache, v_cache in caches:
            # [context, Hkv, D] -> [Hq, context, D]; q: [Hq, tokens, D]
            k = k_cache[row].flatten(0, 1)[:context].repeat_interleave(group, 1).transpose(0, 1)
            v = v_cache[row].flatten(0, 1)[:context].repeat_interleave(group, 1).transpose(0, 1)
            F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=causal)

    return {"C kernel": kernel, "torch path": torch_path}


def median_ms(runs: Paths, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            run()  # warm
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def point_list(sep: str) -> Callable[[str], list[tuple[int, int]]]:
    """An argparse type: comma-separated AsepB points of a positive A and a B >= 0 ("" none)."""

    def parse(text: str) -> list[tuple[int, int]]:
        points = []
        for point in filter(None, (p.strip() for p in text.split(","))):
            try:
                a, b = (int(v) for v in point.split(sep))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{point!r}: expected N{sep}M") from None
            if a < 1 or b < 0:
                raise argparse.ArgumentTypeError(f"{point!r}: N >= 1 and M >= 0")
            points.append((a, b))
        return points

    return parse


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--points",
        type=point_list("x"),
        default="1x256,4x512,32x256,32x512,8x2048",
        help='decodes, BATCHxCONTEXT ("": none)',
    )
    p.add_argument(
        "--chunks",
        type=point_list("@"),
        default="48@0,48@168,48@336,64@960",
        help='prompt chunks, TOKENS@POSITION ("": none)',
    )
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not (cpu_kernel.available() and cpu_kernel.takes_dtype(dtype)):
        print(f"the attention kernel cannot run {args.dtype} here (bf16 needs AVX-512, float32 "
              "AVX2 with FMA; or no C module)")  # fmt: skip
        return 1
    torch.set_num_threads(args.threads)
    print(
        f"{args.layers} layers, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, {args.dtype}, "
        f"{args.threads} threads"
    )
    if args.points:
        print("| batch | context | C kernel ms | torch path ms | kernel GB/s | vs torch |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch, context in args.points:
        ms = median_ms(decode_paths(batch, context, args.layers, args.threads, dtype), args.rounds)
        kv_bytes = 2 * args.layers * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize
        kernel, plain = ms["C kernel"], ms["torch path"]
        print(
            f"| {batch} | {context} | {kernel:.2f} | {plain:.2f} | "
            f"{kv_bytes / kernel / 1e6:.1f} | {plain / kernel:.2f}x |"
        )
    if args.chunks:
        print("| chunk | position | C kernel ms | torch path ms | kernel ns a pair | vs torch |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for tokens, position in args.chunks:
        ms = median_ms(chunk_paths(tokens, position, args.layers, args.threads, dtype), args.rounds)
        # (query token, key row, KV head) pairs: token t attends position + t + 1 rows
        pairs = args.layers * KV_HEADS * (tokens * position + tokens * (tokens + 1) // 2)
        kernel, plain = ms["C kernel"], ms["torch path"]
        print(
            f"| {tokens} | {position} | {kernel:.2f} | {plain:.2f} | "
            f"{kernel * 1e6 / pairs:.1f} | {plain / kernel:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
