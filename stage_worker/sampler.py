"""Next-token sampling on the last stage: greedy, temperature, top-k, top-p.

Replayable: the random draw for the token at position i of a sequence depends only on its
request's seed and i (a counter-based hash, SplitMix64, turned into a uniform number that picks a
token by inverse CDF). No generator state is carried from step to step, so a sequence draws the
same tokens whatever shares its batch, however often it is recomputed (a preemption, a rebuilt
pipeline), and at any PP or TP."""

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
    top_logprobs: int = -1
    """-1: no log-probabilities; k >= 0: the sampled token's and k alternatives."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that is a function of (seed, position) alone: SplitMix64's output for
    the position-th step of the stream that seed starts, its top 53 bits as a double."""
    x = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 11) * 2.0**-53


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


def draw(probs: torch.Tensor, u: float) -> int:
    """The token whose share of the cumulative distribution holds u (probs: [vocab]); a token of
    probability 0 never comes out."""
    cdf = torch.cumsum(probs.double(), dim=0)  # float64: the same boundaries at any batch
    index = int(torch.searchsorted(cdf, cdf[-1] * u, right=True))
    return min(index, probs.shape[0] - 1)


def sample(logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int]) -> list[int]:
    """logits: [n, vocab] float32, one row per sequence; positions: where each sampled token
    goes in its sequence -> n token ids."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (spec, position) in enumerate(zip(specs, positions, strict=True)):
        if spec.greedy:
            continue
        tokens[row] = draw(filtered_probs(logits[row], spec), uniform(spec.seed, position))
    return tokens


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float
    """The sampled token's log-probability."""
    top_token_ids: list[int]
    """The most likely tokens, most likely first."""
    top_logprobs: list[float]


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], counts: list[int]
) -> list[TokenLogprobs | None]:
    """logits: [n, vocab] float32; tokens: the n sampled ids; counts: alternatives per row, -1 for
    a row that wants none -> one entry per row (None where not asked). The model's own
    distribution (log_softmax of the raw logits, before temperature or filtering), as OpenAI and
    vLLM report it; one batched log_softmax and top-k over the rows that ask."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    rows = [i for i, k in enumerate(counts) if k >= 0]
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [r, vocab]
    chosen_ids = torch.tensor([tokens[i] for i in rows], device=logits.device).unsqueeze(1)
    chosen = logp.gather(1, chosen_ids).squeeze(1).tolist()  # [r]
    k_max = max(counts[i] for i in rows)
    top_values, top_ids = logp.topk(k_max, dim=-1) if k_max > 0 else (logp[:, :0], logp[:, :0])
    values, ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = counts[i]
        out[i] = TokenLogprobs(chosen[j], [int(t) for t in ids[j][:k]], values[j][:k])
    return out
