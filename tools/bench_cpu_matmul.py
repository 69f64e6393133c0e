"""One pipeline stage's float32 linear layers on this CPU: torch's F.linear (MKL), oneDNN's
packed matmul (what a worker with several threads used before) and the package's AVX2 kernel
(layers/cpu_matmul.py).

    python tools/bench_cpu_matmul.py [--threads 1] [--tokens 1,2,4,8,16,64,128] [--layers 15]

Shapes are the demo model's (SmolLM2-135M: QKV 576 -> 960, O 576 -> 576, gate-up 576 -> 3,072,
down 1,536 -> 576), 15 layers by default: half the model, one stage of the default PP=2. Prints
the median milliseconds over all of them per step, the three paths alternated in rounds so that
a noisy machine loads all alike, with the weight bytes over the time (GB/s) for the kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from stage_worker.layers import cpu_matmul, onednn

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
"""[out, in] of one demo-model layer's four matmuls."""


def paths(layers: int) -> tuple[int, dict[str, Callable[[dict[int, torch.Tensor]], None]]]:
    """The weights' bytes and, per path, a closure running every layer's matmuls on inputs
    keyed by their width."""
    plain = [torch.randn(out, in_) * 0.02 for _ in range(layers) for out, in_ in SHAPES]
    packed = [cpu_matmul.pack(w) for w in plain]
    blocked = [onednn.pack(w) for w in plain]

    def mkl(xs: dict[int, torch.Tensor]) -> None:
        for w in plain:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    def one_dnn(xs: dict[int, torch.Tensor]) -> None:
        for w, b in zip(plain, blocked, strict=True):
            onednn.linear(xs[w.shape[1]], b)

    def kernel(xs: dict[int, torch.Tensor]) -> None:
        for w, p in zip(plain, packed, strict=True):
            cpu_matmul.linear(xs[w.shape[1]], p)

    nbytes = sum(w.numel() * 4 for w in plain)
    return nbytes, {"F.linear (MKL)": mkl, "oneDNN packed": one_dnn, "AVX2 kernel": kernel}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", default="1,2,4,8,16,64,128")
    p.add_argument("--layers", type=int, default=15)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    if not cpu_matmul.usable_for(torch.empty(1, 1)):
        print("the AVX2 kernel cannot run here (no AVX2 with FMA, or no C module)")
        return 1
    torch.set_num_threads(args.threads)
    nbytes, runs = paths(args.layers)
    print(f"{nbytes / 1e6:.0f} MB of float32 weights, {args.threads} thread(s)")
    print("| tokens | " + " | ".join(f"{n} ms" for n in runs) + " | kernel GB/s | vs MKL |")
    print("| ---: |" + " ---: |" * (len(runs) + 2))
    for tokens in (int(t) for t in args.tokens.split(",")):
        xs = {in_: torch.randn(tokens, in_) for in_ in {s[1] for s in SHAPES}}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                run(xs)  # warm
                start = time.perf_counter()
                run(xs)
                times[name].append((time.perf_counter() - start) * 1e3)
        ms = {name: statistics.median(t) for name, t in times.items()}
        kernel = ms["AVX2 kernel"]
        cells = " | ".join(f"{v:.1f}" for v in ms.values())
        speedup = ms["F.linear (MKL)"] / kernel
        print(f"| {tokens} | {cells} | {nbytes / kernel / 1e6:.1f} | {speedup:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
