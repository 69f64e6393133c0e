"""The package's bf16 matmul kernel (stage_worker/layers/matmul_bf16.py) against oneDNN's
packed bf16 matmul (what it takes over from), on a stack of Llama layers' four weights,
alternated in one process.

    PYTHONPATH=. python tools/bench_bf16_matmul.py [--tokens 1,4,8,12,16,32,64,128] [--rounds 7]
        [--layers 30] [--threads 2]

The default shapes are the demo model's (SmolLM2-135M: hidden 576, MLP 1536, 9 query and 3 KV
heads of 64), with random weights, 30 layers' worth so that they come from memory as a decode
step's do. Each round times every layer's qkv, o_proj, gate_up and down once per kernel, the
order alternating; the table gives the median of the rounds, and GB/s the weight bytes read
per second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from sarathictl.argtypes import comma_list, int_at_least

from stage_worker import native
from stage_worker.layers import matmul_bf16, onednn


def layer_shapes(
    hidden: int, ffn: int, q_heads: int, kv_heads: int, head_dim: int
) -> list[tuple[int, int]]:
    """[out, in] of a Llama layer's qkv, o_proj, gate_up and down."""
    return [
        ((q_heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, q_heads * head_dim),
        (2 * ffn, hidden),
        (hidden, ffn),
    ]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    positive = int_at_least(1)
    p.add_argument("--tokens", type=comma_list(positive), default=(1, 4, 8, 12, 16, 32, 64, 128))
    p.add_argument("--rounds", type=positive, default=7)
    p.add_argument("--layers", type=positive, default=30)
    p.add_argument("--threads", type=int_at_least(0), default=0, help="0: torch's default")
    p.add_argument("--hidden", type=positive, default=576)
    p.add_argument("--ffn", type=positive, default=1536)
    p.add_argument("--q-heads", type=positive, default=9)
    p.add_argument("--kv-heads", type=positive, default=3)
    p.add_argument("--head-dim", type=positive, default=64)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.kernels() is None or not onednn.can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)):
        print("the bf16 kernel or oneDNN's bf16 matmul does not run here (AVX-512 with bf16)")
        return 1
    shapes = layer_shapes(args.hidden, args.ffn, args.q_heads, args.kv_heads, args.head_dim)
    weights = [
        [(onednn.pack(w), matmul_bf16.pack(w)) for w in (torch.randn(s).bfloat16() for s in shapes)]
        for _ in range(args.layers)
    ]
    gb = 2 * args.layers * sum(o * i for o, i in shapes) / 1e9
    print(
        f"{torch.get_num_threads()} threads, {args.layers} layers, {gb * 1e3:.0f} MB of weights\n"
    )
    print("| tokens | oneDNN ms | kernel ms | oneDNN GB/s | kernel GB/s | oneDNN / kernel |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.tokens:
        xs = [torch.randn(n, i).bfloat16() for _, i in shapes]
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for mine in (False, True) if r % 2 == 0 else (True, False):
                start = time.perf_counter()
                for layer in weights:
                    for x, (packed, panels) in zip(xs, layer, strict=True):
                        if mine:
                            matmul_bf16.linear(x, panels)
                        else:
                            onednn.linear(x, packed)
                times[mine].append((time.perf_counter() - start) * 1e3)
        a, b = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"| {n} | {a:.2f} | {b:.2f} | {gb / a * 1e3:.1f} | {gb / b * 1e3:.1f} | {a / b:.2f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
