"""The layers each stage holds: the default split evens out the stages' decode work with the LM
head counted on the last stage, a given split is checked against the model, and a pipeline of
uneven stages computes what one stage does."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from stage_worker.config import ModelSpec, spec_from_config
from stage_worker.layer_split import balanced_split, default_split, head_cost_in_layers
from tests.unit.stage_worker.inprocess import generate, make_runners

REPO = Path(__file__).resolve().parents[3]


def _spec(**fields: int) -> ModelSpec:
    base = dict(family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                num_kv_heads=3, head_dim=64, ffn_size=1536, norm_eps=1e-5)  # fmt: skip
    return ModelSpec(**{**base, **fields})  # type: ignore[arg-type]


def _slowest(split: tuple[int, ...], extra: float) -> float:
    return max(*split[:-1], split[-1] + extra) if len(split) > 1 else split[0] + extra


@pytest.mark.parametrize("extra", [0.0, 0.26, 1.0, 2.5, 4.8, 9.0])
def test_no_other_split_has_a_faster_slowest_stage(extra: float) -> None:
    for num_layers, pp in itertools.product(range(1, 13), range(1, 5)):
        if num_layers < pp:
            continue
        ours = balanced_split(num_layers, pp, extra)
        assert sum(ours) == num_layers and len(ours) == pp and min(ours) >= 1
        every = (
            s
            for s in itertools.product(range(1, num_layers + 1), repeat=pp)
            if sum(s) == num_layers
        )
        best = min(_slowest(s, extra) for s in every)
        assert _slowest(ours, extra) == pytest.approx(best), (num_layers, pp, ours)


def test_without_extra_work_the_split_is_even() -> None:
    assert balanced_split(30, 2, 0.0) == (15, 15)
    assert balanced_split(80, 4, 0.0) == (20, 20, 20, 20)
    assert balanced_split(7, 3, 0.0) == (3, 2, 2)


def test_the_demo_model_gives_its_head_stage_fewer_layers() -> None:
    """SmolLM2-135M: the tied head is 28 M parameters, 8 layers' worth of linear weights; an even
    15/15 split made stage 1 the pipeline's bottleneck (BENCHMARKS.md, step breakdown)."""
    demo = _spec(tie_word_embeddings=True)
    assert 4 < head_cost_in_layers(demo) < 6
    assert default_split(demo, 2) == (17, 13)
    assert default_split(demo, 1) == (30,)


def test_falcon_180b_splits_evenly() -> None:
    """A head under half a layer moves no layer: the paper's layouts stay as they were."""
    config = json.loads((REPO / "stage_worker/configs/falcon-180b.json").read_text())
    spec = spec_from_config(config)
    assert head_cost_in_layers(spec) < 0.5
    assert default_split(spec, 2) == (40, 40)
    assert default_split(spec, 4) == (20,) * 4


def test_an_uneven_pipeline_generates_what_one_stage_does(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    model_dir = tiny_checkpoint("llama")
    prompts = [[5, 17, 33, 2, 91, 12, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    one = generate(make_runners(model_dir, pp=1, num_blocks=32), prompts, max_tokens=8)
    runners = make_runners(model_dir, pp=3, num_blocks=32, layer_split=(1, 4, 1))
    assert [len(r.model.layers) for r in runners] == [1, 4, 1]
    uneven = generate(runners, prompts, max_tokens=8)
    assert uneven.tokens == one.tokens
