"""Bad checkpoints are refused at start-up naming the field or tensor and the numbers; a bad
StepPlan is refused without touching the cache or any sequence's state."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sarathi_proto import stage_pb2

from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ShardSpec, load_spec
from stage_worker.errors import CheckpointError, PlanError
from tests.unit.stage_worker.inprocess import make_runners


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def build(
    model_dir: Path,
    pp: int = 1,
    tp: int = 1,
    stage: int = 0,
    rank: int = 0,
    layer_split: tuple[int, ...] = (),
) -> None:
    from stage_worker.models import build_stage

    reader = CheckpointReader(model_dir)
    shard = ShardSpec(pp=pp, tp=tp, stage=stage, tp_rank=rank, layer_split=layer_split)
    build_stage(load_spec(model_dir), shard, TPGroup(tp, rank), "cpu", torch.float32, reader)


def test_unsupported_architecture_is_named(
    tmp_path: Path, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_spec(model_dir)


def test_missing_tensor_is_named(tmp_path: Path, tiny_checkpoint: Callable[[str], Path]) -> None:
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    build(model_dir, pp=2, stage=0)  # stage 0 holds layers 0..2 and never reads layer 3
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.3\.mlp\.up_proj"):
        build(model_dir, pp=2, stage=1)


def test_wrong_shape_names_tensor_and_both_shapes(
    tmp_path: Path, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = copy_checkpoint(tiny_checkpoint("falcon_new"), tmp_path / "m")
    tensors = load_file(str(model_dir / "model.safetensors"))
    name = "transformer.h.0.self_attention.dense.weight"
    tensors[name] = tensors[name][:, :32].contiguous()
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"dense\.weight has shape \(64, 32\), expected \(64, 64\)"
    ):
        build(model_dir)


def test_fewer_layers_than_stages_are_refused(tiny_checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(CheckpointError, match="num_hidden_layers=6 is fewer than pp=7"):
        build(tiny_checkpoint("llama"), pp=7)


@pytest.mark.parametrize("split", [(3, 2), (4, 2, 0), (7, -1)])
def test_a_layer_split_that_does_not_fit_the_model_is_refused(
    tiny_checkpoint: Callable[[str], Path], split: tuple[int, ...]
) -> None:
    pp = len(split)
    with pytest.raises(CheckpointError, match=r"--layer-split .*num_hidden_layers=6"):
        build(tiny_checkpoint("llama"), pp=pp, layer_split=split)


def test_heads_not_divisible_by_tp_are_refused(tiny_checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(CheckpointError, match="num_attention_heads=4 is not divisible by tp=3"):
        build(tiny_checkpoint("llama"), tp=3)


def make_plan(
    batch_id: int, seq_id: int, num_tokens: int, blocks: list[int], first: bool
) -> stage_pb2.StepPlan:
    plan = stage_pb2.StepPlan(batch_id=batch_id)
    seq = plan.seqs.add(
        seq_id=seq_id,
        first_position=0,
        num_tokens=num_tokens,
        yields_token=True,
        new_block_ids=blocks,
        token_ids=list(range(1, num_tokens + 1)),
    )
    if first:
        seq.sampling.CopyFrom(stage_pb2.SamplingParams(top_p=1.0))
    return plan


def test_plans_naming_an_unknown_sequence_or_a_block_beyond_the_cache_change_nothing(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    (runner,) = make_runners(tiny_checkpoint("llama"), pp=1, num_blocks=4)
    good = runner.prepare(make_plan(1, seq_id=7, num_tokens=5, blocks=[2], first=True))
    runner.sample(good, runner.logits(good, runner.forward(good, None)))
    cache_before = runner.kv_cache.data.clone()
    state_before = (list(runner.seqs[7].block_ids), runner.seqs[7].num_computed_tokens)

    with pytest.raises(PlanError, match="unknown sequence 8"):
        runner.prepare(make_plan(2, seq_id=8, num_tokens=3, blocks=[1], first=False))
    with pytest.raises(PlanError, match="block 4, beyond the cache of 4 blocks"):
        runner.prepare(make_plan(3, seq_id=9, num_tokens=3, blocks=[4], first=True))

    assert torch.equal(runner.kv_cache.data, cache_before)
    assert set(runner.seqs) == {7}
    assert (runner.seqs[7].block_ids, runner.seqs[7].num_computed_tokens) == state_before


def decode_plan(
    batch_id: int, seq_ids: list[int], positions: list[int], tokens: list[int], **blocks: list[int]
) -> stage_pb2.StepPlan:
    plan = stage_pb2.StepPlan(batch_id=batch_id)
    plan.decodes.seq_ids.extend(seq_ids)
    plan.decodes.positions.extend(positions)
    plan.decodes.token_ids.extend(tokens)
    plan.decodes.new_block_at.extend(blocks.get("at", []))
    plan.decodes.new_block_ids.extend(blocks.get("ids", []))
    return plan


def test_bad_decode_columns_change_nothing(tiny_checkpoint: Callable[[str], Path]) -> None:
    (runner,) = make_runners(tiny_checkpoint("llama"), pp=1, num_blocks=8)
    for batch_id, seq_id in ((1, 7), (2, 8)):
        first = runner.prepare(
            make_plan(batch_id, seq_id, num_tokens=16, blocks=[seq_id - 6], first=True)
        )
        runner.forward(first, None)
    cache_before = runner.kv_cache.data.clone()
    states = {i: (list(s.block_ids), s.num_computed_tokens) for i, s in runner.seqs.items()}

    bad = {
        "unknown sequence 9": decode_plan(3, [7, 9], [16, 16], [1, 1], at=[0, 1], ids=[3, 4]),
        "expected position 16": decode_plan(3, [7, 8], [16, 15], [1, 1], at=[0, 1], ids=[3, 4]),
        "needs 17 KV slots, has 16": decode_plan(3, [7, 8], [16, 16], [1, 1], at=[0], ids=[3]),
        "block 8, beyond the cache": decode_plan(
            3, [7, 8], [16, 16], [1, 1], at=[0, 1], ids=[3, 8]
        ),
        "1 token ids for 2 decodes": decode_plan(3, [7, 8], [16, 16], [1], at=[0, 1], ids=[3, 4]),
        "sequence 7 appears twice": decode_plan(3, [7, 7], [16, 16], [1, 1], at=[0, 1], ids=[3, 4]),
        "not ascending": decode_plan(3, [7, 8], [16, 16], [1, 1], at=[1, 0], ids=[3, 4]),
    }
    for message, plan in bad.items():
        with pytest.raises(PlanError, match=message):
            runner.prepare(plan)
    assert torch.equal(runner.kv_cache.data, cache_before)
    assert {i: (list(s.block_ids), s.num_computed_tokens) for i, s in runner.seqs.items()} == states

    good = runner.prepare(decode_plan(3, [7, 8], [16, 16], [1, 2], at=[0, 1], ids=[3, 4]))
    assert good.sample_seq_ids == [7, 8] and good.sample_rows == [0, 1]
    assert runner.seqs[7].block_ids == [1, 3] and runner.seqs[8].num_computed_tokens == 17


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{", "not JSON"),
        ("[1, 2]", "holds no JSON object"),
        ('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4}',
         "missing field vocab_size"),
    ],
)  # fmt: skip
def test_an_unreadable_config_is_one_checkpoint_error(tmp_path: Path, text: str, why: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=why):
        load_spec(tmp_path)
