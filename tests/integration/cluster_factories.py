"""A tiny servable model folder: random Llama weights (transformers' save_pretrained), a byte-level
BPE tokenizer trained on a few sentences, and a chat template. Tests only."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_SIZE = 320  # the tokenizer uses 300 of them; the rest are never produced by it
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. Pipelines keep every stage busy.",
    "Chunked prefills split long prompts; decodes never stall behind them.",
    "héllo wörld, naïve café: unicode text crosses token boundaries 東京 🚀",
] * 20


def make_tiny_served_model(out_dir: Path, seed: int = 0, num_layers: int = 4) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "chat_template": CHAT_TEMPLATE, "add_bos_token": False})
    )
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: no near-tied greedy choices
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, (4.0 if "embed" in name else 1.0) / p.shape[1] ** 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def oracle_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, ignoring EOS, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]
