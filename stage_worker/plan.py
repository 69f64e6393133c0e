"""`python -m stage_worker.plan --config CONFIG.json --tp T --pp P`: the sharding plan of a model
without its weights. Every (stage, TP rank) is built on the meta device, so the parameter bytes
per GPU are counted from the very modules a worker would load, not from a formula."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stage_worker.comm import TPGroup
from stage_worker.config import ShardSpec, spec_from_config
from stage_worker.kv_cache import bytes_per_block
from stage_worker.models import DTYPES, build_stage


@dataclass(frozen=True)
class ShardPlan:
    stage: int
    tp_rank: int
    first_layer: int
    num_layers: int
    param_bytes: int
    kv_bytes_per_token: int


def shard_plans(config: dict[str, Any], tp: int, pp: int, dtype: torch.dtype) -> list[ShardPlan]:
    spec = spec_from_config(config)
    plans = []
    for stage in range(pp):
        for rank in range(tp):
            shard = ShardSpec(pp=pp, tp=tp, stage=stage, tp_rank=rank)
            model = build_stage(spec, shard, TPGroup(tp, rank), "meta", dtype, reader=None)
            kv = bytes_per_block(
                len(model.layers), 1, model.num_kv_heads_local, spec.head_dim, dtype
            )
            plans.append(
                ShardPlan(
                    stage,
                    rank,
                    model.layer_ids.start,
                    len(model.layer_ids),
                    model.param_bytes,
                    kv,
                )
            )
    return plans


def format_table(plans: list[ShardPlan]) -> str:
    lines = [
        "| stage | tp rank | layers | parameter GB | KV bytes / token |",
        "|---:|---:|---:|---:|---:|",
    ]
    for p in plans:
        layers = f"{p.first_layer}..{p.first_layer + p.num_layers - 1}"
        lines.append(
            f"| {p.stage} | {p.tp_rank} | {layers} | {p.param_bytes / 1e9:.2f} "
            f"| {p.kv_bytes_per_token} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stage_worker.plan", description=__doc__)
    parser.add_argument("--config", required=True, help="a Hugging Face config.json")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--json", action="store_true", help="one JSON object per shard")
    args = parser.parse_args(argv)
    config = json.loads(Path(args.config).read_text())
    plans = shard_plans(config, args.tp, args.pp, DTYPES[args.dtype])
    if args.json:
        for p in plans:
            print(json.dumps(p.__dict__))
        return 0
    print(f"{args.config}: TP{args.tp}-PP{args.pp}, {args.dtype}")
    print(format_table(plans))
    most = max(p.param_bytes for p in plans)
    total = sum(p.param_bytes for p in plans)
    print(f"largest GPU share: {most / 1e9:.2f} GB of parameters; all GPUs: {total / 1e9:.1f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
