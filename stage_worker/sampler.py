"""Next-token sampling on the last stage: greedy, temperature, top-k, top-p. Each sequence owns a
torch.Generator seeded once from its request's seed and advanced one draw per token, so a seed
gives the same tokens whatever else shares the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def make_generator(seed: int, device: str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def filtered_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """logits: [vocab] float32 -> probabilities [vocab] after temperature, top-k and top-p."""
    x = logits / spec.temperature
    if 0 < spec.top_k < x.shape[0]:
        kth = torch.topk(x, spec.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= spec.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(
    logits: torch.Tensor, specs: list[SamplingSpec], generators: list[torch.Generator]
) -> list[int]:
    """logits: [n, vocab] float32, one row per sequence -> n token ids."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (spec, gen) in enumerate(zip(specs, generators, strict=True)):
        if spec.greedy:
            continue
        probs = filtered_probs(logits[row], spec)
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
