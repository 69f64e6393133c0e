"""The analytic cost model against hand-computed values, and the layouts it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.scheduler import MicroBatch, ScheduledChunk
from controller.simulator import (
    AnalyticCostModel,
    Deployment,
    Efficiency,
    MeasuredProfile,
    get_gpu,
    get_link,
    get_model,
    model_from_hf_config,
)

# Falcon-180B (tiiuae/falcon-180B config.json), worked by hand:
# QKV 14848 x (232*64 + 2*8*64) + dense 14848 x 14848 + MLP 2 x 14848 x 59392 = 14848 x 149504.
FALCON_PARAMS_PER_LAYER = 14848 * 149504
FALCON_EMBEDDING_PARAMS = 65024 * 14848
A100_BANDWIDTH = 2039e9


def falcon_tp4_pp2(**kwargs: object) -> Deployment:
    return Deployment(
        get_model("falcon-180b"),
        get_gpu("a100"),
        tp=4,
        pp=2,
        stage_link=get_link("eth-100g"),
        tp_link=get_link("nvlink"),
        **kwargs,  # type: ignore[arg-type]
    )


def decode_batch(contexts: list[int]) -> MicroBatch:
    chunks = [ScheduledChunk(i, c - 1, 1, True, (), [0], None) for i, c in enumerate(contexts)]
    return MicroBatch(1, chunks, [], len(chunks))


def prefill_batch(num_tokens: int, first_position: int = 0) -> MicroBatch:
    chunk = ScheduledChunk(0, first_position, num_tokens, False, (), [0] * num_tokens, None)
    return MicroBatch(1, [chunk], [], num_tokens)


def test_falcon_weight_bytes_per_gpu_at_tp4_pp2() -> None:
    d = falcon_tp4_pp2()
    per_stage_params = 40 * FALCON_PARAMS_PER_LAYER + FALCON_EMBEDDING_PARAMS
    assert d.weight_bytes_per_gpu == per_stage_params * 2 // 4
    assert d.weight_bytes_per_gpu == pytest.approx(44.88e9, rel=1e-3)


def test_decode_time_floor_of_one_stage_is_the_weight_read() -> None:
    e = Efficiency(layer_overhead_s=0.0, step_overhead_s=0.0)
    model = AnalyticCostModel(falcon_tp4_pp2(), e)
    cost = model.micro_batch_cost(decode_batch([1]))
    weights_s = 40 * FALCON_PARAMS_PER_LAYER / 4 * 2 / (A100_BANDWIDTH * 0.8)
    # Two ring all-reduces per layer over NVLink: 2 * (4 - 1) steps of 5 us, plus one token's bytes.
    allreduce_s = 2 * 40 * (2 * 3 * 5e-6 + 2 * 3 / 4 * 14848 * 2 / (300e9 * 0.8))
    kv_read_s = (2 * 2 * 64 * 2 * 40) / (A100_BANDWIDTH * 0.6)  # 2 KV heads per GPU, K and V
    assert cost.stage_times_s[0] == pytest.approx(weights_s + allreduce_s + kv_read_s, rel=1e-9)
    assert weights_s == pytest.approx(0.0272, abs=1e-4)
    # The last stage also reads the LM head's shard to sample the token.
    head_s = FALCON_EMBEDDING_PARAMS / 4 * 2 / (A100_BANDWIDTH * 0.8)
    assert cost.stage_times_s[1] - cost.stage_times_s[0] == pytest.approx(head_s, rel=1e-9)


def test_activation_transfer_between_stages() -> None:
    cost = AnalyticCostModel(falcon_tp4_pp2()).micro_batch_cost(prefill_batch(512))
    assert cost.transfer_s == pytest.approx(30e-6 + 512 * 14848 * 2 / (12.5e9 * 0.8), rel=1e-9)


def test_large_prefill_is_compute_bound() -> None:
    e = Efficiency(layer_overhead_s=0.0, step_overhead_s=0.0)
    model = AnalyticCostModel(Deployment(get_model("mistral-7b"), get_gpu("a100")), e)
    params = 32 * 4096 * (4096 + 2 * 1024 + 4096 + 3 * 14336)  # Mistral-7B's 32 layers
    linear_s = 2 * 2048 * params / (312e12 * 0.7)
    # Causal attention of a 2048-token prompt: query i sees i + 1 keys; 4 FLOPs per head-dim.
    attention_s = 2048 * (2048 - 2047 / 2) * 4 * 32 * 128 * 32 / (312e12 * 0.5)
    t2k = model.micro_batch_cost(prefill_batch(2048)).stage_times_s[0]
    assert t2k == pytest.approx(linear_s + attention_s, rel=1e-9)
    assert linear_s == pytest.approx(0.131, abs=1e-3)


def test_decodes_pay_for_the_kv_they_read() -> None:
    model = AnalyticCostModel(Deployment(get_model("yi-34b"), get_gpu("a100"), tp=2))
    short = model.micro_batch_cost(decode_batch([100] * 32)).stage_times_s[0]
    long = model.micro_batch_cost(decode_batch([4100] * 32)).stage_times_s[0]
    kv_bytes = 32 * 4000 * (2 * 4 * 128 * 2 * 60)  # 4 KV heads per GPU at TP2, 60 layers
    assert long - short == pytest.approx(kv_bytes / (A100_BANDWIDTH * 0.6), rel=1e-9)


def test_tp8_across_nodes_pays_ethernet_all_reduces() -> None:
    model = get_model("falcon-180b")
    gpu, eth, nvlink = get_gpu("a100"), get_link("eth-100g"), get_link("nvlink")
    across = AnalyticCostModel(Deployment(model, gpu, 8, 1, eth, nvlink, nodes_per_stage=2))
    inside = AnalyticCostModel(Deployment(model, gpu, 8, 1, eth, nvlink, nodes_per_stage=1))
    assert across.decode_step_s(32, 4096) > 1.5 * inside.decode_step_s(32, 4096)


def test_layouts_that_cannot_hold_the_model_are_refused_with_numbers() -> None:
    with pytest.raises(ValueError, match=r"cannot hold falcon-180b on a100: 3[0-9]{2}\.\d GB"):
        Deployment(get_model("falcon-180b"), get_gpu("a100"), tp=1, pp=1)
    with pytest.raises(ValueError, match="80 layers, not divisible into pp=3"):
        Deployment(get_model("falcon-180b"), get_gpu("a100"), tp=8, pp=3)
    with pytest.raises(ValueError, match="232 attention heads, not divisible by tp=3"):
        Deployment(get_model("falcon-180b"), get_gpu("a100"), tp=3, pp=2)


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="a100, a40, h100"):
        get_gpu("v100")
    with pytest.raises(ValueError, match="eth-100g, eth-25g, nvlink, pcie4"):
        get_link("infiniband")
    with pytest.raises(ValueError, match="falcon-180b, llama2-70b, mistral-7b, yi-34b"):
        get_model("gpt-5")


def test_any_hugging_face_config_json(tmp_path: Path) -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
        "hidden_act": "silu",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = get_model(str(tmp_path))
    assert (spec.num_layers, spec.head_dim, spec.num_kv_heads) == (30, 64, 3)
    assert spec.linear_params_per_layer == 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    falcon = model_from_hf_config(
        {
            "model_type": "falcon",
            "hidden_size": 14848,
            "num_attention_heads": 232,
            "num_kv_heads": 8,
            "new_decoder_architecture": True,
            "num_hidden_layers": 80,
            "vocab_size": 65024,
        }
    )
    assert falcon.linear_params_per_layer == FALCON_PARAMS_PER_LAYER


def test_measured_profile_interpolates_between_rows(tmp_path: Path) -> None:
    path = tmp_path / "profile.csv"
    path.write_text(
        "num_tokens,context_tokens,stage_time_s\n"
        "1,0,0.010\n512,0,0.050\n1,4096,0.020\n512,4096,0.070\n"
    )
    profile = MeasuredProfile.from_csv(path, num_stages=2, transfer_s=0.001)
    assert profile.stage_time_s(256, 0) == pytest.approx(0.010 + 0.040 * 255 / 511)
    assert profile.stage_time_s(512, 2048) == pytest.approx(0.060)
    cost = profile.micro_batch_cost(decode_batch([4096]))
    assert cost.stage_times_s == [pytest.approx(0.020)] * 2
    assert cost.transfer_s == 0.001


def test_measured_profile_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "profile.csv"
    path.write_text("num_tokens,context_tokens,stage_time_s\n1,0,0.01\n8,-5,0.02\n")
    with pytest.raises(ValueError, match="line 3"):
        MeasuredProfile.from_csv(path)
    path.write_text("num_tokens,stage_time_s\n1,0.01\n")
    with pytest.raises(ValueError, match=r"line 1: missing column.*context_tokens"):
        MeasuredProfile.from_csv(path)
