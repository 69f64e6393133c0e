"""GGUF -> Hugging Face folder conversion, on a tiny Llama GGUF written here with gguf.GGUFWriter
(no network): weights renamed and un-permuted, config from metadata, tokenizer rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from sarathictl.model_prep.convert import convert_gguf
from sarathictl.model_prep.errors import ModelPrepError
from sarathictl.model_prep.gguf_weights import hf_tensor_name, unpermute_rotary_rows
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from controller.tokenizer import Tokenizer

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 32, 4, 2, 64, 2
HEAD_DIM = HIDDEN // HEADS
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to attn_q / attn_k rows (its `permute`)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def tiny_vocab() -> list[str]:
    return [*SPECIAL, *sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt", "he", "Ġthe", "12"]


def tiny_hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face name -> float32 weights of a tiny Llama with tied embeddings."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": rand(len(tiny_vocab()), HIDDEN)}
    weights["model.norm.weight"] = rand(HIDDEN)
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = rand(HIDDEN)
        weights[p + "post_attention_layernorm.weight"] = rand(HIDDEN)
        weights[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        weights[p + "mlp.gate_proj.weight"] = rand(INTER, HIDDEN)
        weights[p + "mlp.up_proj.weight"] = rand(INTER, HIDDEN)
        weights[p + "mlp.down_proj.weight"] = rand(HIDDEN, INTER)
    return weights


def gguf_name(hf_name: str) -> str:
    names = {hf_tensor_name(g): g for g in ("token_embd.weight", "output_norm.weight")}
    if hf_name in names:
        return names[hf_name]
    layer = hf_name.split(".")[2]
    for suffix in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                   "ffn_gate", "ffn_up", "ffn_down"):  # fmt: skip
        candidate = f"blk.{layer}.{suffix}.weight"
        if hf_tensor_name(candidate) == hf_name:
            return candidate
    raise AssertionError(hf_name)


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray] | None = None,
    *,
    architecture: str = "llama",
    skip_tensor: str | None = None,
) -> dict[str, np.ndarray]:
    """A GGUF laid out as llama.cpp writes one (q/k permuted, FFN in Q8_0); returns the
    Hugging Face weights it encodes."""
    weights = tiny_hf_weights() if weights is None else weights
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tiny_vocab())
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(tiny_vocab()) - len(SPECIAL)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    for hf_name, value in weights.items():
        name = gguf_name(hf_name)
        if name == skip_tensor:
            continue
        if name.endswith("attn_q.weight"):
            value = llama_cpp_permute(value, HEADS)
        elif name.endswith("attn_k.weight"):
            value = llama_cpp_permute(value, KV_HEADS)
        if any(f".{kind}." in name for kind in ("ffn_gate", "ffn_up", "ffn_down")):
            quantized = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rows = np.arange(HEADS * HEAD_DIM * 3, dtype=np.float32).reshape(HEADS * HEAD_DIM, 3)
    permuted = llama_cpp_permute(rows, HEADS)
    assert not np.array_equal(permuted, rows)  # the test would notice a no-op
    assert np.array_equal(unpermute_rotary_rows(permuted, HEADS), rows)


def test_unknown_gguf_tensor_is_refused_by_name() -> None:
    assert hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    with pytest.raises(ModelPrepError, match=r"blk\.0\.ssm_a"):
        hf_tensor_name("blk.0.ssm_a")


def test_converted_folder_has_hf_weights_config_and_tokenizer(tmp_path: Path) -> None:
    weights = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "model"
    out.mkdir()
    sizes = convert_gguf(tmp_path / "tiny.gguf", out, "float32")
    assert set(sizes) == {p.name for p in out.iterdir()}

    converted = load_file(str(out / "model.safetensors"))
    assert set(converted) == set(weights)  # tied embeddings: no lm_head.weight
    for name, expected in weights.items():
        if ".mlp." in name:  # Q8_0 keeps about 2 decimal digits of each block's scale
            np.testing.assert_allclose(converted[name], expected, atol=0.05)
        else:  # F32 in the GGUF, and q/k un-permuted exactly
            np.testing.assert_array_equal(converted[name], expected, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_attention_heads"]) == (HIDDEN, HEADS)
    assert (config["num_key_value_heads"], config["num_hidden_layers"]) == (KV_HEADS, LAYERS)
    assert config["rms_norm_eps"] == 1e-5  # not float32's 9.99999974738e-06
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == len(tiny_vocab())
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_converted_tokenizer_splits_digits_and_keeps_control_tokens_whole(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "model"
    out.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out, "bfloat16")
    backend = BackendTokenizer.from_file(str(out / "tokenizer.json"))
    vocab = tiny_vocab()
    assert backend.encode(" the").ids == [vocab.index("Ġthe")]
    # smollm pre-tokenizer: each digit alone, so the "12" merge never applies
    assert backend.encode("12").ids == [vocab.index("1"), vocab.index("2")]
    assert backend.encode("<|im_end|>x").ids == [2, vocab.index("x")]

    tokenizer = Tokenizer.from_dir(out)  # the controller reads the folder as written
    assert tokenizer.eos_token_ids == {2}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


def test_bfloat16_is_the_default_dtype_on_disk(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "model"
    out.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out, "bfloat16")
    header_len = int.from_bytes((out / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((out / "model.safetensors").read_bytes()[8 : 8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_other_architectures_are_refused(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", architecture="falcon")
    with pytest.raises(ModelPrepError, match=r"general\.architecture='falcon'"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path, "bfloat16")


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", skip_tensor="blk.1.ffn_up.weight")
    with pytest.raises(ModelPrepError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path, "bfloat16")


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    weights = tiny_hf_weights()
    weights["model.layers.0.self_attn.v_proj.weight"] = np.zeros((HIDDEN, HIDDEN), np.float32)
    write_tiny_gguf(tmp_path / "tiny.gguf", weights)
    with pytest.raises(ModelPrepError, match=r"blk\.0\.attn_v\.weight.*\[32, 32\].*\[16, 32\]"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path, "bfloat16")
