"""Decode attention over a paged KV cache on this CPU: the package's C kernel
(attention/cpu_kernel.py) against the torch path it replaces (a gather of every sequence's
blocks, then batched products).

    python tools/bench_cpu_attention.py [--threads 2] [--points 1x256,4x512,32x256] [--layers 30]

Heads are the demo model's (SmolLM2-135M: 9 query heads, 3 KV heads of 64), float32, 16-token
blocks in shuffled order. Each point (BATCHxCONTEXT) runs every layer's attention in turn over
that layer's own caches, 30 layers by default as in the model, so the caches come from memory
as in a step and not from the last level cache. Prints the median milliseconds over all layers,
the two paths alternated in rounds so that a noisy machine loads both alike, and the KV bytes
read over the kernel's time (GB/s).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from stage_worker.attention import cpu_kernel
from stage_worker.attention.torch_backend import paged_decode

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def paths(batch: int, context: int, layers: int, threads: int) -> dict[str, Callable[[], None]]:
    """Per path, a closure attending one query token per sequence in every layer."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK_SIZE)
    shape = (batch * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
              for _ in range(layers)]  # fmt: skip
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
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


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--points", default="1x256,4x512,32x256,32x512,8x2048", help="BATCHxCONTEXT")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if not (cpu_kernel.available() and cpu_kernel.takes_dtype(torch.float32)):
        print("the attention kernel cannot run float32 here (no AVX2 with FMA, or no C module)")
        return 1
    torch.set_num_threads(args.threads)
    print(f"{args.layers} layers, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, {args.threads} threads")
    print("| batch | context | C kernel ms | torch path ms | kernel GB/s | vs torch |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for point in args.points.split(","):
        batch, context = (int(v) for v in point.split("x"))
        runs = paths(batch, context, args.layers, args.threads)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                run()  # warm
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1e3)
        ms = {name: statistics.median(t) for name, t in times.items()}
        kv_bytes = 2 * args.layers * batch * context * KV_HEADS * HEAD_DIM * 4
        kernel, plain = ms["C kernel"], ms["torch path"]
        print(
            f"| {batch} | {context} | {kernel:.2f} | {plain:.2f} | "
            f"{kv_bytes / kernel / 1e6:.1f} | {plain / kernel:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
