"""The model as config.json describes it, and where one worker sits in the PP x TP grid."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stage_worker.errors import CheckpointError
from stage_worker.layer_split import stage_layers

# architectures value in config.json -> our model family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "FalconForCausalLM": "falcon",
    "RWForCausalLM": "falcon",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); factor 1 means none."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """What the stage builder needs from a Hugging Face config.json, checked on construction."""

    family: str
    """"llama" or "falcon"."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    # Falcon only: the fused query_key_value layout and the layer's wiring.
    new_decoder_architecture: bool = False
    multi_query: bool = False
    parallel_attn: bool = False
    num_ln_in_parallel_attn: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise CheckpointError(f"config.json: {name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def num_q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def _get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is None:
        raise CheckpointError(f"config.json: missing field {names[0]}")
    return default


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes rope_parameters; older configs have rope_theta and rope_scaling.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"config.json: rope_type={rope_type!r} unsupported (default, llama3)")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def spec_from_config(cfg: dict[str, Any]) -> ModelSpec:
    """config.json's fields as a ModelSpec; refuses a model we cannot run with a CheckpointError
    naming the field."""
    family = _family(cfg)
    # The fields both families share (older Falcon configs call them n_embed and n_head).
    hidden = int(_get(cfg, "hidden_size", "n_embed"))
    heads = int(_get(cfg, "num_attention_heads", "n_head"))
    theta, scaling = _rope(cfg)
    if family == "llama":
        return _llama_spec(cfg, hidden, heads, theta, scaling)
    return _falcon_spec(cfg, hidden, heads, theta, scaling)


def _family(cfg: dict[str, Any]) -> str:
    """The model family, llama or falcon: from architectures, else from model_type."""
    archs = cfg.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None:
        family = {"llama": "llama", "mistral": "llama", "falcon": "falcon"}.get(
            cfg.get("model_type", "")
        )
    if family is None:
        raise CheckpointError(
            f"config.json: architectures={archs} model_type={cfg.get('model_type')!r} is "
            f"unsupported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return family


def _llama_spec(
    cfg: dict[str, Any], hidden: int, heads: int, theta: float, scaling: RopeScaling | None
) -> ModelSpec:
    """Llama and Mistral: no biases, SiLU, RMSNorm; grouped-query attention when
    num_key_value_heads is below num_attention_heads."""
    # Refused, not ignored: the stage has neither bias weights nor another activation, so such
    # a checkpoint would load (its extra tensors unread) and give wrong outputs.
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise CheckpointError("config.json: attention_bias/mlp_bias=true is unsupported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act={cfg['hidden_act']!r} (need silu)")
    return ModelSpec(
        family="llama",
        vocab_size=int(_get(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_get(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_get(cfg, "head_dim", default=hidden // heads)),
        ffn_size=int(_get(cfg, "intermediate_size")),
        norm_eps=float(_get(cfg, "rms_norm_eps", default=1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _falcon_spec(
    cfg: dict[str, Any], hidden: int, heads: int, theta: float, scaling: RopeScaling | None
) -> ModelSpec:
    """Falcon (rotary, no biases, GELU), in either query_key_value layout."""
    _check_falcon_supported(cfg)
    new_arch = bool(cfg.get("new_decoder_architecture", False))
    multi_query = bool(cfg.get("multi_query", True))
    kv_heads = _falcon_kv_heads(cfg, heads, new_arch, multi_query)
    num_ln = cfg.get("num_ln_in_parallel_attn")
    return ModelSpec(
        family="falcon",
        vocab_size=int(_get(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_get(cfg, "num_hidden_layers", "n_layer")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        ffn_size=int(_get(cfg, "ffn_hidden_size", default=4 * hidden)),
        norm_eps=float(_get(cfg, "layer_norm_epsilon", default=1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        new_decoder_architecture=new_arch,
        multi_query=multi_query,
        parallel_attn=bool(cfg.get("parallel_attn", True)),
        num_ln_in_parallel_attn=int(num_ln) if num_ln is not None else (2 if new_arch else 1),
    )


def _check_falcon_supported(cfg: dict[str, Any]) -> None:
    """Refuses the Falcon variants the stage does not implement: like a Llama with biases,
    they would load and give wrong outputs."""
    if cfg.get("alibi"):
        raise CheckpointError("config.json: alibi=true is unsupported (rotary Falcons only)")
    if cfg.get("bias"):
        raise CheckpointError(
            "config.json: bias=true is unsupported (Falcon-7B/40B/180B have none)"
        )
    if cfg.get("activation", "gelu") != "gelu":
        raise CheckpointError(f"config.json: activation={cfg['activation']!r} (need gelu)")


def _falcon_kv_heads(cfg: dict[str, Any], heads: int, new_arch: bool, multi_query: bool) -> int:
    """The new decoder architecture (40B, 180B) states its KV heads; the old one (7B) has one
    shared KV head with multi_query, else one per query head."""
    if new_arch:
        return int(_get(cfg, "num_kv_heads", "n_head_kv", default=heads))
    return 1 if multi_query else heads


def load_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: holds no JSON object")
    return spec_from_config(cfg)


@dataclass(frozen=True)
class ShardSpec:
    """One worker's place: pipeline stage and TP rank, and the shares that follow from them."""

    pp: int
    tp: int
    stage: int
    tp_rank: int
    layer_split: tuple[int, ...] = ()
    """Layers per stage, stage 0 first; empty: the default split (stage_worker/layer_split.py)."""

    def __post_init__(self) -> None:
        if self.pp < 1 or self.tp < 1:
            raise ValueError(f"pp={self.pp} and tp={self.tp} must be >= 1")
        if not 0 <= self.stage < self.pp:
            raise ValueError(f"stage={self.stage} must be in [0, {self.pp})")
        if not 0 <= self.tp_rank < self.tp:
            raise ValueError(f"tp_rank={self.tp_rank} must be in [0, {self.tp})")

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def global_rank(self) -> int:
        return self.stage * self.tp + self.tp_rank

    def layer_range(self, spec: ModelSpec) -> range:
        return stage_layers(spec, self.pp, self.stage, self.layer_split)

    def check_heads(self, spec: ModelSpec) -> None:
        if spec.num_heads % self.tp:
            raise CheckpointError(
                f"config.json: num_attention_heads={spec.num_heads} is not divisible by "
                f"tp={self.tp}"
            )
        kv = spec.num_kv_heads
        if kv % self.tp and self.tp % kv:
            raise CheckpointError(
                f"config.json: num_key_value_heads={kv} and tp={self.tp}: one must divide the other"
            )
        if spec.ffn_size % self.tp:
            raise CheckpointError(
                f"config.json: intermediate size {spec.ffn_size} is not divisible by tp={self.tp}"
            )

    def q_heads(self, spec: ModelSpec) -> range:
        """Query heads this rank computes (contiguous)."""
        n = spec.num_heads // self.tp
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    def kv_heads(self, spec: ModelSpec) -> range:
        """KV heads this rank holds: a contiguous share, or one replicated head when tp > kv."""
        kv = spec.num_kv_heads
        if self.tp <= kv:
            n = kv // self.tp
            return range(self.tp_rank * n, (self.tp_rank + 1) * n)
        head = self.tp_rank // (self.tp // kv)
        return range(head, head + 1)
