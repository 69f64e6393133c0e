"""One layer's attention for a prompt's later chunk: SDPA with the boolean mask the torch path
gives it, against PyTorch's lower-right causal bias, at growing context.

    python tools/bench_chunk_attention.py [--device cuda] [--chunk 512] [--contexts 512,...]

Mistral-7B's heads (32 query, 8 KV, 128 wide), bf16, the chunk's keys already gathered. Made to
test a suspicion that the mask sends CUDA SDPA to a slow kernel; on an H200 the two cost the
same (BENCHMARKS.md, "Part 3 live on an H200"). Prints ms per layer for each and the ratio; x32
is a whole Mistral-7B step's chunk attention. Run by tools/gpu_check.sh (part `bench-chunks`);
on the CPU it runs too, slower.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from sarathictl.bench.stage_step import time_ms
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention as sdpa

HQ, HKV, D = 32, 8, 128


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chunk", type=int, default=512, help="the chunk's tokens")
    p.add_argument(
        "--contexts", default="512,1024,2048,4096,8192", help="cached tokens before the chunk"
    )
    args = p.parse_args(argv)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"one layer, chunk of {args.chunk} tokens, {HQ}/{HKV} heads of {D}, bf16, on {name}\n")
    print("| cached tokens | boolean mask ms | lower-right bias ms | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    n = args.chunk
    for cached in (int(c) for c in args.contexts.split(",")):
        length = cached + n
        q = torch.randn(1, HQ, n, D, device=args.device, dtype=torch.bfloat16)
        k = torch.randn(1, HKV, length, D, device=args.device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q_pos = torch.arange(cached, length, device=args.device)
        mask = torch.arange(length, device=args.device)[None, :] <= q_pos[:, None]  # [n, L]
        bias = causal_lower_right(n, length)
        masked = time_ms(partial(sdpa, q, k, v, attn_mask=mask, enable_gqa=True), args.device, 10)
        biased = time_ms(partial(sdpa, q, k, v, attn_mask=bias, enable_gqa=True), args.device, 10)
        print(f"| {cached} | {masked:.3f} | {biased:.3f} | {masked / biased:.1f}x |")


if __name__ == "__main__":
    main()
