"""One Llama layer's elementwise work (two RMSNorms, rotary on q and k, SiLU-times-up) as
torch's own ops against the fused kernels (layers/fused.py), on this machine's CPU or GPU.

    python tools/bench_fused_ops.py [--device cpu] [--dtype float32] [--tokens 1,4,64] [--threads 1]

Shapes are the demo model's (SmolLM2-135M: hidden 576, 9 + 3 heads of 64, MLP 1536) unless
given. Prints the median microseconds of the whole chain per layer, alternating the two paths
in rounds so that a noisy machine loads both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from stage_worker.layers import RMSNorm, RotaryEmbedding, fused
from stage_worker.models.llama import silu_mul


def chain(tokens: int, args: argparse.Namespace, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """A closure running one layer's elementwise ops on fresh random activations."""
    d, heads = args.head_dim, args.q_heads + 2 * args.kv_heads
    norms = [RMSNorm(args.hidden, 1e-5, args.device, dtype) for _ in range(2)]
    rope = RotaryEmbedding(d, 10000.0, None, args.device)
    cos, sin = rope.cos_sin(torch.arange(tokens, device=args.device) + 100, dtype)
    x = torch.randn(tokens, args.hidden, device=args.device).to(dtype)
    qkv = torch.randn(tokens, heads * d, device=args.device).to(dtype)
    gate_up = torch.randn(tokens, 2 * args.ffn, device=args.device).to(dtype)
    qk_heads = args.q_heads + args.kv_heads

    def run() -> None:
        norms[0](x)
        RotaryEmbedding.apply(qkv[:, : qk_heads * d].view(tokens, qk_heads, d), cos, sin)
        norms[1](x)
        silu_mul(gate_up)

    return run


def time_us(run, calls: int, device: str) -> float:  # type: ignore[no-untyped-def]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tokens", default="1,4,64")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (the fused ops share a step over them)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    probe = torch.zeros(1, device=args.device, dtype=dtype)
    print(
        f"{args.device}, {args.dtype}, {args.threads} thread(s), fused kernels: "
        f"{fused.kernels_for(probe) is not None}"
    )
    print("| tokens | torch ops µs | fused µs | speed-up |")
    print("| ---: | ---: | ---: | ---: |")
    for tokens in (int(t) for t in args.tokens.split(",")):
        run = chain(tokens, args, dtype)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for enabled in (False, True):
                fused.set_enabled(enabled)
                run()  # warm
                times[enabled].append(time_us(run, args.calls, args.device))
        fused.set_enabled(True)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {tokens} | {off:.1f} | {on:.1f} | {off / on:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
