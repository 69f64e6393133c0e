"""A Llama GGUF's metadata as a Hugging Face `config.json` and `generation_config.json`.

llama.cpp writes the model's shape under `llama.*` keys; the names map one to one onto
`LlamaConfig` fields. Only what our stage workers (and transformers, the test oracle) read is
written, so nothing in the folder is a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFReader

from sarathictl.model_prep.defaults import DTYPE_NAMES
from sarathictl.model_prep.errors import ModelPrepError


def read_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python value; `default` when absent, an error when required."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelPrepError(f"the GGUF has no metadata key {key!r}, which a Llama model needs")
        return default
    return field.contents()


def float32_value(value: float) -> float:
    # GGUF stores float32: 1e-5 arrives as 9.99999974738e-06. The shortest decimal that rounds to
    # the same float32 is what the original config.json said.
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class LlamaShape:
    """The numbers that define a Llama-architecture checkpoint, read from GGUF metadata."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int | None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
            if getattr(self, name) < 1:
                raise ModelPrepError(f"{name}={getattr(self, name)} is invalid: at least 1")
        if self.num_attention_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ModelPrepError(
                f"num_attention_heads={self.num_attention_heads} is invalid: a positive multiple "
                f"of num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelPrepError(f"head_dim={self.head_dim} is invalid: rotary needs it even")
        for name in ("bos_token_id", "eos_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ModelPrepError(
                    f"{name}={getattr(self, name)} is invalid: in [0, {self.vocab_size})"
                )


def read_llama_shape(reader: GGUFReader) -> LlamaShape:
    architecture = read_field(reader, "general.architecture")
    if architecture != "llama":
        raise ModelPrepError(
            f"general.architecture={architecture!r} is not supported: only 'llama' GGUFs convert"
        )
    if "llama.rope.scaling.type" in reader.fields or "rope_freqs.weight" in tensor_names(reader):
        raise ModelPrepError("the GGUF uses rope scaling, which this converter does not handle")
    hidden_size = int(read_field(reader, "llama.embedding_length"))
    num_heads = int(read_field(reader, "llama.attention.head_count"))
    if num_heads < 1 or hidden_size % num_heads:
        raise ModelPrepError(
            f"llama.attention.head_count={num_heads} is invalid: must divide "
            f"llama.embedding_length={hidden_size}"
        )
    num_tokens_in_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    pad_token_id = reader.fields.get("tokenizer.ggml.padding_token_id")
    return LlamaShape(
        hidden_size=hidden_size,
        intermediate_size=int(read_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(read_field(reader, "llama.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(read_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(read_field(reader, "llama.rope.dimension_count", hidden_size // num_heads)),
        rope_theta=float32_value(read_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float32_value(read_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        vocab_size=int(read_field(reader, "llama.vocab_size", num_tokens_in_vocab)),
        max_position_embeddings=int(read_field(reader, "llama.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names(reader),
        bos_token_id=int(read_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(read_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=None if pad_token_id is None else int(pad_token_id.contents()),
    )


def tensor_names(reader: GGUFReader) -> set[str]:
    return {tensor.name for tensor in reader.tensors}


def config_json(shape: LlamaShape, dtype: str) -> dict[str, Any]:
    """`config.json` for `LlamaForCausalLM`."""
    if dtype not in DTYPE_NAMES:
        raise ModelPrepError(f"dtype={dtype!r} is invalid: one of {', '.join(DTYPE_NAMES)}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": shape.rms_norm_eps,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": shape.bos_token_id,
        "eos_token_id": shape.eos_token_id,
        "pad_token_id": shape.pad_token_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def generation_config_json(shape: LlamaShape) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bos_token_id": shape.bos_token_id,
        "eos_token_id": shape.eos_token_id,
    }
    if shape.pad_token_id is not None:
        config["pad_token_id"] = shape.pad_token_id
    return config
