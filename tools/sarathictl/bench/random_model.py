"""Random-weight model folders for benchmarks: a Falcon (new decoder architecture) of a chosen
size, or a Llama-architecture model of a known shape (Mistral-7B's among them), each with a
byte-level BPE tokenizer, so a whole cluster can serve it with no download."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

EOS = "<|endoftext|>"
BYTE_TOKENIZER_SIZE = 257
"""The byte-level tokenizer holds every byte plus its end-of-sequence token."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. Pipelines keep every stage busy.",
    "Chunked prefills split long prompts; decodes never stall behind them.",
    "héllo wörld, naïve café: unicode text crosses token boundaries 東京 🚀",
] * 20


def write_byte_tokenizer(out_dir: Path, vocab_size: int = 300) -> int:
    """tokenizer.json (byte-level BPE trained on a few sentences) and tokenizer_config.json with
    a chat template; returns the end-of-sequence token id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "chat_template": CHAT_TEMPLATE, "add_bos_token": False})
    )
    eos_id = tokenizer.token_to_id(EOS)
    assert eos_id is not None, "the trainer adds the special token"
    return int(eos_id)


@dataclass(frozen=True)
class FalconShape:
    hidden_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_kv_heads: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads")


def write_random_falcon(out_dir: Path, shape: FalconShape, seed: int = 0) -> Path:
    """config.json + model.safetensors (float32) of a Falcon with the new decoder architecture
    (grouped KV heads, parallel attention and MLP, two layer norms), plus a tokenizer."""
    import torch
    from safetensors.torch import save_file

    h, heads, kv = shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads
    d = h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen) / size[-1] ** 0.5

    tensors = {
        "transformer.word_embeddings.weight": rand(shape.vocab_size, h) * 4,
        "transformer.ln_f.weight": torch.ones(h),
        "transformer.ln_f.bias": torch.zeros(h),
    }
    for i in range(shape.num_hidden_layers):
        p = f"transformer.h.{i}."
        tensors |= {
            p + "ln_attn.weight": torch.ones(h),
            p + "ln_attn.bias": torch.zeros(h),
            p + "ln_mlp.weight": torch.ones(h),
            p + "ln_mlp.bias": torch.zeros(h),
            # rows: per KV group, its query heads then one key and one value head
            p + "self_attention.query_key_value.weight": rand((heads + 2 * kv) * d, h),
            p + "self_attention.dense.weight": rand(h, h),
            p + "mlp.dense_h_to_4h.weight": rand(4 * h, h),
            p + "mlp.dense_4h_to_h.weight": rand(h, 4 * h),
        }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    eos_id = write_byte_tokenizer(out_dir, vocab_size=min(300, shape.vocab_size))
    config = {
        "architectures": ["FalconForCausalLM"],
        "model_type": "falcon",
        **asdict(shape),
        "new_decoder_architecture": True,
        "parallel_attn": True,
        "multi_query": True,
        "bias": False,
        "alibi": False,
        "layer_norm_epsilon": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": eos_id,
        "bos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir


# Llama-architecture shapes (`bench stage --random-shape`, `model random-llama`): config.json
# fields.
SHAPES: dict[str, dict[str, int | float | bool]] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True, rope_theta=10000.0,
    ),
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
    ),
    "mistral-7b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False, rope_theta=1e6,
    ),
}  # fmt: skip


def shape_config(shape: str) -> dict[str, object]:
    """The config.json of a Llama shape."""
    cfg: dict[str, object] = dict(SHAPES[shape], architectures=["LlamaForCausalLM"])
    cfg.update(model_type="llama", rms_norm_eps=1e-5, hidden_act="silu")
    cfg.update(max_position_embeddings=8192)
    return cfg


def write_random_llama(
    model_dir: Path, shape: str, dtype: torch.dtype, seed: int = 0, device: str = "cpu"
) -> Path:
    """config.json, model.safetensors (N(0, 0.02) matrices in dtype, norms 1) and, where the
    vocabulary holds it, a byte-level tokenizer of a Llama shape. Mistral-7B's takes 14.5 GB
    in bfloat16, held in memory whole before it is written. `device` draws the numbers (a
    GPU's generator draws Mistral-7B's 7.2 G in well under a second where one CPU core takes a
    minute or more; the values differ from the CPU's)."""
    import torch
    from safetensors.torch import save_file

    shape_cfg = SHAPES[shape]
    h, f = int(shape_cfg["hidden_size"]), int(shape_cfg["intermediate_size"])
    heads, kv = int(shape_cfg["num_attention_heads"]), int(shape_cfg["num_key_value_heads"])
    vocab, num_layers = int(shape_cfg["vocab_size"]), int(shape_cfg["num_hidden_layers"])
    d = h // heads
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * 0.02).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": rand(vocab, h)}
    tensors["model.norm.weight"] = torch.ones(h, dtype=dtype)
    if not shape_cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(vocab, h)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * d, h),
            p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * d, h),
            p + "self_attn.o_proj.weight": rand(h, heads * d),
            p + "mlp.gate_proj.weight": rand(f, h),
            p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(model_dir / "model.safetensors"))
    cfg = shape_config(shape)
    if vocab >= BYTE_TOKENIZER_SIZE:  # else token ids only (bench stage's tiny shape)
        eos_id = write_byte_tokenizer(model_dir, vocab_size=min(300, vocab))
        cfg |= {"eos_token_id": eos_id, "bos_token_id": eos_id}
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    return model_dir
