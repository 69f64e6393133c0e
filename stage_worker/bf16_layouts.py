"""Which layouts a CPU stage holds its bf16 weights in, chosen before they load: the bf16
kernel measured against oneDNN on stand-ins of the stage's own weight shapes
(layers/matmul_bf16_dispatch.py), then what fits in the memory this worker may take. The
choice is matmul_bf16.REACH, which ShardedLinear.pack and ParallelLMHead.pack follow: no panels
where the kernel loses even at one token, panels only where it wins at every size (or where
both layouts would not fit and it is the faster one), both otherwise."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from stage_worker import host_memory
from stage_worker.comm import TPGroup
from stage_worker.config import ModelSpec, ShardSpec
from stage_worker.layers import matmul_bf16, matmul_bf16_dispatch
from stage_worker.models import StageModel, build_stage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageBytes:
    """A stage's weight bytes in its two layout choices."""

    once: int
    """Held with panels only: every weight once (a tied head's panels beside the embedding's
    rows, which lookups need)."""
    both_extra: int
    """More with both layouts: every linear weight again, and the LM head twice (untied: its
    rows kept for refining oneDNN's logits, and oneDNN's copy; tied: oneDNN's copy)."""


def stage_bytes(stage: StageModel, tied: bool) -> StageBytes:
    """stage: built on the meta device (shapes only, nothing tied yet: a tied matrix counts
    once as the embedding and once as the head, which is what panels-only holds too)."""
    linear = sum(out * in_ for out, in_ in stage.linear_shapes())
    head = stage.lm_head.weight.numel() if stage.lm_head is not None else 0
    size = stage.dtype.itemsize
    return StageBytes(stage.param_bytes, (linear + head * (1 if tied else 2)) * size)


def choose(
    spec: ModelSpec,
    shard: ShardSpec,
    tp_group: TPGroup,
    device: str,
    dtype: torch.dtype,
    kv_cache_bytes: int,
    workers_on_host: int,
) -> None:
    """Measures and sets matmul_bf16.REACH for this stage (module doc); nothing where the bf16
    kernel does not run. workers_on_host: the workers loading on this machine at once, who
    share its memory (each judges its share)."""
    if not matmul_bf16.usable_for(torch.empty((1, 1), dtype=dtype, device=device)):
        return
    stage = build_stage(spec, shard, tp_group, "meta", dtype, None)
    t0 = time.monotonic()
    calibration = matmul_bf16_dispatch.measure_shapes(stage.linear_shapes())
    logger.info("%s, in %.2f s", calibration.describe(), time.monotonic() - t0)
    tied = spec.tie_word_embeddings and stage.embed is not None and stage.lm_head is not None
    sizes = stage_bytes(stage, tied)
    available = host_memory.available_bytes()
    reach = calibration.max_tokens
    if available is not None:
        share = available // workers_on_host
        needed = sizes.once + kv_cache_bytes
        reach = matmul_bf16_dispatch.within_memory(calibration, needed, sizes.both_extra, share)
        if reach != calibration.max_tokens:
            held = "once, as its panels" if reach else "once, in oneDNN's layout"
            logger.warning(
                "each bf16 weight held %s, though the measurement chose both layouts: "
                "oneDNN's copies (%.1f GiB) would not fit beside the stage's weights and KV "
                "cache (%.1f GiB) in this worker's %.1f GiB of memory",
                held,
                sizes.both_extra / 2**30,
                needed / 2**30,
                share / 2**30,
            )
    matmul_bf16.REACH.max_tokens = reach
