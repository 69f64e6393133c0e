"""Model shapes for the cost model: presets from public Hugging Face configs, or any config.json.

Only the numbers that decide FLOPs and bytes are kept: layer count, widths, head counts, MLP kind
and vocabulary. Weights are assumed BF16 (2 bytes per parameter), as the paper serves them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BYTES_PER_PARAM = 2  # bf16 weights, activations and KV cache


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    num_mlp_matrices: int = 3
    """3 for gated MLPs (SwiGLU: gate, up, down), 2 for plain GELU MLPs (Falcon)."""
    sliding_window_tokens: int = 0
    """Attention window (Mistral); 0 for full causal attention."""

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_hidden_size",
            "vocab_size",
        ):
            value = getattr(self, field_name)
            if value < 1:
                raise ValueError(f"{self.name}: {field_name} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.num_mlp_matrices not in (2, 3):
            raise ValueError(f"{self.name}: num_mlp_matrices must be 2 or 3")

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of one decoder layer's matmuls: QKV, output projection and MLP."""
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_width + 2 * kv_width) + q_width * self.hidden_size
        mlp = self.num_mlp_matrices * self.hidden_size * self.ffn_hidden_size
        return attention + mlp

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Layers plus input embedding plus LM head (counted twice even when tied: with PP>1
        the first and last stages each hold a copy)."""
        return self.num_layers * self.linear_params_per_layer + 2 * self.embedding_params


MODELS: dict[str, ModelSpec] = {
    # mistralai/Mistral-7B-v0.1 config.json
    "mistral-7b": ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000, 3, 4096),
    # 01-ai/Yi-34B config.json
    "yi-34b": ModelSpec("yi-34b", 60, 7168, 56, 8, 128, 20480, 64000),
    # meta-llama/Llama-2-70b-hf config.json
    "llama2-70b": ModelSpec("llama2-70b", 80, 8192, 64, 8, 128, 28672, 32000),
    # tiiuae/falcon-180B config.json: new decoder architecture, MLP 4x hidden with GELU.
    "falcon-180b": ModelSpec("falcon-180b", 80, 14848, 232, 8, 64, 4 * 14848, 65024, 2),
}
MODEL_ALIASES = {
    "mistral": "mistral-7b",
    "yi": "yi-34b",
    "llama-2-70b": "llama2-70b",
    "llama2": "llama2-70b",
    "falcon": "falcon-180b",
}


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or a Hugging Face config.json (or a folder holding one) by path."""
    key = MODEL_ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in MODELS:
        return MODELS[key]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return model_from_hf_config(json.loads(path.read_text()), name=path.parent.name or key)
    raise ValueError(
        f"unknown model {name_or_path!r}; known: {', '.join(sorted(MODELS))}, "
        "or a path to a Hugging Face config.json"
    )


def _first(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is not None:
        return default
    raise ValueError(f"config.json lacks {' / '.join(keys)}")


def model_from_hf_config(config: dict[str, Any], name: str = "custom") -> ModelSpec:
    """Llama-family (Llama, Mistral, Yi, Qwen2, SmolLM) and Falcon configs."""
    hidden = int(_first(config, "hidden_size", "n_embd", "d_model"))
    num_heads = int(_first(config, "num_attention_heads", "n_head"))
    is_falcon = config.get("model_type") == "falcon" or "falcon" in str(config.get("architectures"))
    if is_falcon:
        if config.get("new_decoder_architecture"):
            num_kv_heads = int(_first(config, "num_kv_heads", default=num_heads))
        else:
            num_kv_heads = 1 if config.get("multi_query", True) else num_heads
        ffn = int(_first(config, "ffn_hidden_size", default=4 * hidden))
        mlp_matrices = 2
    else:
        num_kv_heads = int(_first(config, "num_key_value_heads", default=num_heads))
        ffn = int(_first(config, "intermediate_size", "ffn_hidden_size", default=4 * hidden))
        mlp_matrices = 3 if config.get("hidden_act", "silu") in ("silu", "swiglu") else 2
    head_dim = int(_first(config, "head_dim", default=hidden // num_heads))
    window = config.get("sliding_window") or 0
    if config.get("use_sliding_window") is False:
        window = 0
    return ModelSpec(
        name=name,
        num_layers=int(_first(config, "num_hidden_layers", "n_layer", "num_layers")),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=ffn,
        vocab_size=int(_first(config, "vocab_size")),
        num_mlp_matrices=mlp_matrices,
        sliding_window_tokens=int(window),
    )
