"""Two builds of the package's C module side by side in one process: decode attention through
each, alternated call by call, so that a noisy machine slows both alike.

    cp stage_worker/_kernels*.so /tmp/a.so      # the build to compare against
    ... change stage_worker/csrc, then: python setup.py build_ext --inplace
    PYTHONPATH=. python tools/ab_attention_builds.py /tmp/a.so stage_worker/_kernels*.so \
        [--points 1x512,8x512,32x512] [--threads 1] [--rounds 12]

Shapes are tools/bench_cpu_attention.py's (the demo model's 9/3 heads of 64, float32, 16-token
blocks in shuffled order, 30 layers so that the caches come from memory). For each point
(BATCHxCONTEXT decodes) prints each build's median milliseconds for all layers over the rounds,
B over A, and the largest difference between their outputs. Each round runs A then B or B then
A, in turns.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from types import ModuleType

import torch
from bench_cpu_attention import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, random_caches
from torch.utils.dlpack import to_dlpack

LAYERS = 30


def load_build(path: str, package: str) -> ModuleType:
    """The extension at path, imported under a package name of its own (its init symbol is
    PyInit__kernels whatever the package, so two builds load side by side)."""
    spec = importlib.util.spec_from_file_location(f"{package}._kernels", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(builds: list[ModuleType], batch: int, context: int, threads: int, rounds: int) -> str:
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK_SIZE)
    caches = random_caches(batch * per_seq, LAYERS, gen, torch.float32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    table = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int64)
    outs = [torch.empty_like(q) for _ in builds]
    times: list[list[float]] = [[] for _ in builds]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            scratch = torch.empty(threads * builds[i].attention_scratch_floats(
                HEADS, KV_HEADS, context))  # fmt: skip
            start = time.perf_counter()
            for k, v in caches:
                builds[i].paged_attention(
                    to_dlpack(q), to_dlpack(k), to_dlpack(v), to_dlpack(table), to_dlpack(lens),
                    to_dlpack(scratch), to_dlpack(outs[i]), HEAD_DIM**-0.5, threads,
                )  # fmt: skip
            times[i].append(time.perf_counter() - start)
    a, b = (statistics.median(t) * 1e3 for t in times)
    diff = (outs[0] - outs[1]).abs().max().item()
    return f"| {batch} | {context} | {a:.2f} | {b:.2f} | {b / a:.3f} | {diff:.1e} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="the build to compare against (a copy of _kernels*.so)")
    parser.add_argument("b", help="the other build")
    parser.add_argument("--points", default="1x512,8x512,32x512", help="BATCHxCONTEXT, ...")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12, help="calls of each build a point")
    args = parser.parse_args(argv)
    builds = [load_build(args.a, "build_a"), load_build(args.b, "build_b")]
    print(f"{LAYERS} layers, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, float32, "
          f"{args.threads} threads, medians of {args.rounds} rounds")  # fmt: skip
    print("| batch | context | A ms | B ms | B/A | largest difference |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for point in args.points.split(","):
        batch, context = (int(x) for x in point.split("x"))
        print(compare(builds, batch, context, args.threads, args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
