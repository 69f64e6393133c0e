"""Tiny random-weight checkpoints written with transformers' save_pretrained (safetensors), and
the transformers oracle. transformers is a test dependency only."""

from __future__ import annotations

from pathlib import Path

import torch

# Six layers split evenly for PP in {1, 2, 3}; a vocabulary that TP=2 cannot split evenly.
NUM_LAYERS = 6
VOCAB_SIZE = 251
ARCHS = ("llama", "falcon_new", "falcon_mq")


def _llama_config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _falcon_config(new_arch: bool):  # type: ignore[no-untyped-def]
    from transformers import FalconConfig

    return FalconConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=8 if new_arch else 4,
        num_kv_heads=2 if new_arch else None,
        new_decoder_architecture=new_arch,
        multi_query=True,
        parallel_attn=True,
        bias=False,
        alibi=False,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def make_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Writes config.json + model.safetensors of a tiny random model to out_dir."""
    from transformers import AutoModelForCausalLM

    config = _llama_config() if arch == "llama" else _falcon_config(arch == "falcon_new")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger random weights than the default init, so greedy choices are not near-ties that
    # summation order (TP) could flip.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                gain = 4.0 if "embed" in name or "word_embeddings" in name else 1.0
                p.normal_(0.0, gain / p.shape[1] ** 0.5)
            else:
                p.uniform_(0.8, 1.2) if name.endswith("weight") else p.normal_(0.0, 0.1)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


def load_oracle(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def oracle_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' greedy generate (on the model's device): the token ids after the prompt."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, len(prompt) :]]


@torch.inference_mode()
def oracle_last_logits(model, token_ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[vocab] float32 logits at the last position of token_ids."""
    return model(torch.tensor([token_ids])).logits[0, -1].float()
