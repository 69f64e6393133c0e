"""Reads slices of safetensors tensors by name, so no process materializes the full model."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from stage_worker.errors import CheckpointError


class CheckpointReader:
    """All *.safetensors files of a Hugging Face folder (single file or sharded with an index)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu") -> None:
        self.model_dir = Path(model_dir)
        self._stack = ExitStack()
        self._files: dict[str, Any] = {}  # file name -> open safe_open handle
        self._where: dict[str, str] = {}  # tensor name -> file name
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._where.update(weight_map)
        else:
            files = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.model_dir}: no *.safetensors file")
            for name in files:
                for key in self._open(name).keys():  # noqa: SIM118 (safe_open is not a dict)
                    self._where[key] = name

    def _open(self, file_name: str) -> Any:
        handle = self._files.get(file_name)
        if handle is None:
            handle = self._stack.enter_context(
                safe_open(str(self.model_dir / file_name), framework="pt", device="cpu")
            )
            self._files[file_name] = handle
        return handle

    def close(self) -> None:
        self._stack.close()

    def has(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str, shape: tuple[int, ...]) -> Any:
        if name not in self._where:
            raise CheckpointError(f"checkpoint: missing tensor {name} (expected shape {shape})")
        sl = self._open(self._where[name]).get_slice(name)
        found = tuple(sl.get_shape())
        if found != shape:
            raise CheckpointError(f"checkpoint: tensor {name} has shape {found}, expected {shape}")
        return sl

    def full(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self._slice(name, shape)[:]

    def rows(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor whose full shape must be `shape` (dim 0 is sliced)."""
        return self._slice(name, shape)[start:stop]

    def cols(self, name: str, shape: tuple[int, int], start: int, stop: int) -> torch.Tensor:
        """Columns [start, stop) of a 2-D tensor of full shape `shape`."""
        return self._slice(name, shape)[:, start:stop]
