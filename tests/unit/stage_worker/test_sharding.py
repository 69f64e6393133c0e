"""Tensor-parallel slicing: each rank reads exactly its heads of every fused layout, KV heads are
replicated when TP exceeds them, and the Falcon-180B TP4-PP2 plan has the published size."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ModelSpec, ShardSpec, load_spec, spec_from_config
from stage_worker.layers.embedding import vocab_range
from stage_worker.models import build_stage
from stage_worker.models.falcon import fused_qkv_rows
from stage_worker.plan import shard_plans

REPO_ROOT = Path(__file__).resolve().parents[3]
D, HIDDEN = 4, 8  # head_dim, hidden size of the fake weights (only row order matters here)


def falcon_spec(heads: int, kv_heads: int, new_arch: bool, multi_query: bool = True) -> ModelSpec:
    return ModelSpec(
        family="falcon",
        vocab_size=10,
        hidden_size=HIDDEN,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=D,
        ffn_size=32,
        norm_eps=1e-5,
        new_decoder_architecture=new_arch,
        multi_query=multi_query,
    )


def write_qkv(tmp_path: Path, rows: int) -> tuple[CheckpointReader, torch.Tensor]:
    # row r of the weight is filled with r, so a slice shows which rows it took
    weight = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, HIDDEN).contiguous()
    save_file({"qkv": weight}, str(tmp_path / "model.safetensors"))
    return CheckpointReader(tmp_path), weight


def head_rows(weight: torch.Tensor, heads: list[int], layout: torch.Tensor) -> torch.Tensor:
    return torch.cat([weight[layout[h] * D : layout[h] * D + D] for h in heads])


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_new_decoder_layout_gives_each_rank_its_query_heads_and_their_kv_head(
    tmp_path: Path, tp: int
) -> None:
    heads, kv = 8, 2  # groups of 4 query heads + 1 key + 1 value head
    spec = falcon_spec(heads, kv, new_arch=True)
    group = heads // kv + 2
    reader, weight = write_qkv(tmp_path, (heads + 2 * kv) * D)
    # where each head starts, in head_dim units, in the transformers layout
    q_at = torch.tensor([(h // 4) * group + h % 4 for h in range(heads)])
    k_at = torch.tensor([g * group + group - 2 for g in range(kv)])
    v_at = k_at + 1
    hidden_total = 0
    for rank in range(tp):
        shard = ShardSpec(pp=1, tp=tp, stage=0, tp_rank=rank)
        shard.check_heads(spec)
        local = fused_qkv_rows(reader, "qkv", spec, shard)
        q_heads, kv_heads = list(shard.q_heads(spec)), list(shard.kv_heads(spec))
        expected = torch.cat(
            [
                head_rows(weight, q_heads, q_at),
                head_rows(weight, kv_heads, k_at),
                head_rows(weight, kv_heads, v_at),
            ]
        )
        assert torch.equal(local, expected), f"rank {rank} of tp={tp}"
        # each query head's KV head is the one the rank holds
        assert {h // 4 for h in q_heads} == set(kv_heads)
        hidden_total += len(q_heads)
    assert hidden_total == heads


def test_multi_query_layout_replicates_the_one_kv_head(tmp_path: Path) -> None:
    heads = 4
    spec = falcon_spec(heads, 1, new_arch=False)
    reader, weight = write_qkv(tmp_path, (heads + 2) * D)
    for rank in range(2):
        shard = ShardSpec(pp=1, tp=2, stage=0, tp_rank=rank)
        local = fused_qkv_rows(reader, "qkv", spec, shard)
        q = weight[rank * 2 * D : (rank + 1) * 2 * D]
        kv = weight[heads * D :]
        assert torch.equal(local, torch.cat([q, kv]))


def test_vocabulary_shares_cover_it_once_even_when_tp_does_not_divide_it() -> None:
    for vocab, tp in [(251, 2), (65024, 4), (5, 4)]:
        ranges = [vocab_range(vocab, tp, r) for r in range(tp)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_falcon_180b_tp4_pp2_plan_matches_the_published_size() -> None:
    raw = json.loads((REPO_ROOT / "stage_worker" / "configs" / "falcon-180b.json").read_text())
    spec = spec_from_config(raw)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (
        80,
        14848,
        232,
        8,
    )
    plans = shard_plans(raw, tp=4, pp=2, dtype=torch.bfloat16)

    assert len(plans) == 8
    assert [p.num_layers for p in plans] == [40] * 8
    for p in plans:
        assert 44e9 < p.param_bytes < 46e9  # about 45 GB of bf16 parameters per GPU
        # 40 layers x (K and V) x 2 KV heads (8 over 4 ranks) x head_dim 64 x 2 bytes
        assert p.kv_bytes_per_token == 40 * 2 * 2 * 64 * 2
    assert 355e9 < sum(p.param_bytes for p in plans) < 365e9  # the ~360 GB model, once over


def test_tied_embedding_is_held_once_when_one_stage_has_both_ends(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    model_dir = tiny_checkpoint("falcon_new")  # Falcon ties the LM head to the embedding
    spec = load_spec(model_dir)
    reader = CheckpointReader(model_dir)

    def stage_bytes(pp: int, stage: int) -> int:
        shard = ShardSpec(pp=pp, tp=1, stage=stage, tp_rank=0)
        return build_stage(spec, shard, TPGroup(), "cpu", torch.float32, reader).param_bytes

    embedding_bytes = spec.vocab_size * spec.hidden_size * 4
    whole = stage_bytes(1, 0)
    split = stage_bytes(2, 0) + stage_bytes(2, 1)
    # two stages need two copies, one stage one; the last stage's may be the float32 matmul
    # kernel's panels (layers/cpu_matmul.py), padded to a multiple of 16 rows
    panel_padding = (-spec.vocab_size % 16) * spec.hidden_size * 4
    assert split - whole in (embedding_bytes, embedding_bytes + panel_padding)
