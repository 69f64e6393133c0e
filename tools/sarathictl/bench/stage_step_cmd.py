"""`sarathictl bench stage`'s flags. The benchmark itself (stage_step.py) imports torch and the
stage worker's model code, which the rest of the command line does without, so it is imported
only when the command runs."""

from __future__ import annotations

import argparse

from sarathictl.argtypes import comma_list, device, int_at_least
from sarathictl.bench.random_model import SHAPES
from stage_worker.dtype_names import DTYPE_NAMES

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_CHUNKS = (32, 64, 128, 256, 512, 1024)


def run(args: argparse.Namespace) -> int:
    from sarathictl.bench import stage_step

    return stage_step.run(args)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stage", help="one stage's step time against tokens per step")
    # --help lists the flags in the order they are added here.
    _add_stage_args(p)
    _add_point_args(p)
    _add_kernel_args(p)
    _add_ceiling_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def _add_stage_args(p: argparse.ArgumentParser) -> None:
    """The stage under test and how it runs: a checkpoint or a random shape, dtype, device,
    attention backend, each decode's context in tokens, timed runs per point, torch threads."""
    p.add_argument(
        "--model", help="checkpoint folder (config.json, safetensors); or give --random-shape"
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_NAMES))
    p.add_argument("--device", type=device(), default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--attention", default="torch", choices=["torch", "flashinfer"])
    p.add_argument(
        "--context-tokens",
        type=int_at_least(0),
        default=256,
        help="cached tokens before each decode and each later chunk",
    )
    p.add_argument(
        "--repeats", type=int_at_least(1), default=5, help="timed runs per point (median)"
    )
    p.add_argument(
        "--num-threads", type=int_at_least(0), default=0, help="torch threads (0: default)"
    )
    p.add_argument(
        "--random-shape",
        choices=sorted(SHAPES),
        help="random weights of this shape, drawn on the device; with --model, written there "
        "as a checkpoint first if it holds no config.json",
    )


def _add_point_args(p: argparse.ArgumentParser) -> None:
    """The points timed: decode batch sizes in sequences, prefill chunk lengths in tokens (a
    prompt's first chunk, and later ones over its cached positions)."""
    sizes = comma_list(int_at_least(1), allow_empty=True)
    p.add_argument(
        "--decode-batches",
        type=sizes,
        default=DECODE_BATCHES,
        help="comma-separated decode batch sizes (empty: none)",
    )
    p.add_argument(
        "--prefill-chunks",
        type=sizes,
        default=PREFILL_CHUNKS,
        help="comma-separated prefill chunk lengths (empty: none)",
    )
    p.add_argument(
        "--later-chunks",
        type=sizes,
        default=(),
        help="comma-separated chunk lengths, each timed after --context-tokens of its own prompt "
        "already cached: the chunked policy's steady state (default: none)",
    )


def _add_kernel_args(p: argparse.ArgumentParser) -> None:
    """How the hardware is driven: the optional kernels (small-batch GEMV, C attention, CUDA
    graphs, fused ops, the decode kernel, the CPU matmul and layer loop), each with the path it
    replaces, to compare."""
    p.add_argument(
        "--small-batch-kernel",
        action="store_true",
        help="CPU bf16, one thread: steps of up to 2 tokens on the streaming GEMV kernel",
    )
    p.add_argument(
        "--cpu-attention-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: attention on the C kernel where it runs (AVX-512 with bf16; float32 caches "
        "on AVX2 with FMA) "
        "(--no-cpu-attention-kernel: the plain torch path, to compare)",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, also time each decode point replayed from a CUDA graph",
    )
    p.add_argument(
        "--fused-ops",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="norms, rotary and SiLU-times-up as fused kernels where they can run "
        "(--no-fused-ops: torch's own ops, to compare)",
    )
    p.add_argument(
        "--decode-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA graphs with torch attention: the cache write and the decode attention as "
        "one Triton kernel (--no-decode-kernel: torch's paged_decode, to compare)",
    )
    p.add_argument(
        "--decode-splits",
        type=int_at_least(0),
        default=0,
        help="the decode kernel splits each context this many ways, at most 16 (0: by context "
        "length, one split up to 2,048 tokens)",
    )
    p.add_argument(
        "--cpu-matmul-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: linear layers on the package's matmul kernels where they run (float32 "
        "on AVX2; bf16 steps of up to 64 tokens on AVX-512 with bf16) (--no-cpu-matmul-kernel: "
        "torch's F.linear and oneDNN, to compare)",
    )
    p.add_argument(
        "--cpu-layer-loop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU float32 or bf16, Llama family, TP=1: the layers as one loop over the C "
        "kernels and matmuls (--no-cpu-layer-loop: a module call per layer part, to compare)",
    )


def _add_ceiling_args(p: argparse.ArgumentParser) -> None:
    """The sizes of the copy (bytes) and of the matrix product (side) that measure the two
    ceilings a step is held to."""
    p.add_argument(
        "--copy-bytes",
        type=int_at_least(1),
        default=1 << 30,
        help="size of the bandwidth-measuring copy",
    )
    p.add_argument(
        "--matmul-size",
        type=int_at_least(16),
        default=None,
        help="side of the square matrix product the prefill ceiling is measured with "
        "(default: 8192 on CUDA, 1024 on the CPU)",
    )
