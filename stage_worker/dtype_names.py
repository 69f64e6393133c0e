"""The dtypes a stage worker runs in, by name: importable without torch, for the command lines
that offer them (models.DTYPES maps each to its torch dtype)."""

from __future__ import annotations

DTYPE_NAMES = ("bfloat16", "float16", "float32")
