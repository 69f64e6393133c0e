"""Where a decode step's time goes on a GPU: the kernels of one step of a random-weight stage
(the `bench stage` model), eager and replayed from a CUDA graph, under torch.profiler.

    python tools/gpu_decode_profile.py [--shape mistral-7b] [--batch 1] [--context-tokens 512]

Prints, per step: kernels launched, the sum of their GPU time, the wall time, and the kernels
that took the most time (grouped by name). Kernel time near wall time with the weights' bytes
over it near the copy bandwidth means the step is memory-bound; wall time well above kernel time
means launches set the pace; many small kernels between the matmuls are what fusing removes.
Run by tools/gpu_check.sh (part `bench`); needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from functools import partial

import torch
from sarathictl.bench.random_model import SHAPES, shape_config
from sarathictl.bench.stage_step import StageBench, random_stage
from torch.profiler import ProfilerActivity, profile

from stage_worker.config import spec_from_config
from stage_worker.layers import fused

STEPS = 20


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_steps(step, steps: int) -> tuple[dict[str, list[float]], float]:  # type: ignore[no-untyped-def]
    """Each kernel name's durations (µs) over `steps` steps, and the wall µs per step (timed
    before, without the profiler's overhead)."""
    for _ in range(3):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall_us = (time.perf_counter() - t0) * 1e6 / steps
    on_gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync()
    kernels: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels[event.name].append(event.device_time)
    return kernels, wall_us


def report(title: str, kernels: dict[str, list[float]], wall_us: float, steps: int) -> None:
    count = sum(len(v) for v in kernels.values()) / steps
    busy_us = sum(sum(v) for v in kernels.values()) / steps
    print(f"\n{title}: {count:.0f} kernels a step, {busy_us / 1e3:.2f} ms of kernel time, "
          f"{wall_us / 1e3:.2f} ms wall")  # fmt: skip
    print("| kernel | per step | µs a step | µs each |")
    print("| --- | ---: | ---: | ---: |")
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    for name, times in ranked[:14]:
        print(f"| {name[:70]} | {len(times) / steps:.0f} | {sum(times) / steps:.0f} | "
              f"{sum(times) / len(times):.1f} |")  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="mistral-7b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context-tokens", type=int, default=512)
    p.add_argument("--attention", choices=["torch", "flashinfer"], default="torch")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script")
    args = p.parse_args(argv)
    spec = spec_from_config(shape_config(args.shape))
    model = random_stage(spec, args.device, torch.bfloat16)
    bench = StageBench(
        model, args.context_tokens, args.attention, max_batch=args.batch, max_chunk=16
    )
    step = partial(bench.step, bench.decode_seqs(args.batch))
    print(
        f"{args.shape}, {args.attention} attention, decode batch {args.batch}, "
        f"{args.context_tokens}-token contexts, "
        f"{model.param_bytes / 1e9:.2f} GB of weights, {args.device}"
    )
    for fused_on in (False, True):
        fused.set_enabled(fused_on)
        for graphs in (False, True) if args.device.startswith("cuda") else (False,):
            bench.use_graphs = graphs
            bench._graphs = None  # captured again: the fused switch changes the graph
            kernels, wall_us = profile_steps(step, STEPS)
            name = f"{'graph' if graphs else 'eager'}, fused {'on' if fused_on else 'off'}"
            report(name, kernels, wall_us, STEPS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
