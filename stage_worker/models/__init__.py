"""Model families, built for one stage and one TP rank from a Hugging Face checkpoint."""

from __future__ import annotations

import torch

from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ModelSpec, ShardSpec
from stage_worker.dtype_names import DTYPE_NAMES
from stage_worker.models.base import StageModel
from stage_worker.models.falcon import FalconStage
from stage_worker.models.llama import LlamaStage

FAMILIES: dict[str, type[StageModel]] = {"llama": LlamaStage, "falcon": FalconStage}

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def build_stage(
    spec: ModelSpec,
    shard: ShardSpec,
    tp: TPGroup,
    device: str,
    dtype: torch.dtype,
    reader: CheckpointReader | None,
) -> StageModel:
    """The stage's layers for this TP rank; weights loaded from reader (None: left empty, as on
    the meta device for planning)."""
    model = FAMILIES[spec.family](spec, shard, tp, device, dtype)
    if reader is not None:
        model.load(reader)
    return model.eval()


__all__ = ["DTYPES", "FAMILIES", "StageModel", "build_stage"]
