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
_ARGMAX_BLOCK = 64
"""Logits per block in greedy_tokens: each block's maximum first, vectorized, then the first
block holding the row's maximum."""


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that is a function of (seed, position) alone: SplitMix64's output for
    the position-th step of the stream that seed starts, its top 53 bits as a double."""
    x = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 11) * 2.0**-53


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """logits: [n, vocab] -> each row's argmax (its first maximum, as torch.argmax).

    On the CPU torch's argmax is a scalar loop (3.4 ms over [32, 49152] on an AMD EPYC without
    AVX-512, where amax takes 0.18 ms): the maximum of each 64-logit block first, vectorized,
    then argmax over the block maxima and within the one block, 0.66 ms there."""
    n, vocab = logits.shape
    if logits.device.type != "cpu" or n <= 1:  # one row (or none): nothing to gain
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    if vocab % _ARGMAX_BLOCK:
        pad = _ARGMAX_BLOCK - vocab % _ARGMAX_BLOCK
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    blocks = logits.view(n, -1, _ARGMAX_BLOCK)  # [n, vocab / 64, 64]
    block = blocks.amax(dim=2).argmax(dim=1)  # [n]: the first block holding the maximum
    inside = blocks[torch.arange(n), block].argmax(dim=1)  # [n]
    return (block * _ARGMAX_BLOCK + inside).tolist()


def filtered_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """logits: [vocab] float32 -> probabilities [vocab] after temperature, top-k and top-p."""
    return filtered_rows(logits[None], [spec])[0]


def filtered_rows(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """logits: [m, vocab] float32, one row per sampled (not greedy) sequence -> probabilities
    [m, vocab] after each row's temperature, top-k and top-p: a few batched ops for the whole
    step, each row's result the one it would get alone (every op works row by row)."""
    device, vocab = logits.device, logits.shape[1]
    temperature = torch.tensor([s.temperature for s in specs], device=device)
    x = logits / temperature[:, None]
    ks = [s.top_k if 0 < s.top_k < vocab else 0 for s in specs]
    if any(ks):
        top_k = torch.tensor(ks, device=device)
        ranked = torch.topk(x, max(ks), dim=1).values  # [m, largest k]
        kth = ranked.gather(1, (top_k.clamp(min=1) - 1)[:, None])  # [m, 1]
        kth = torch.where(top_k[:, None] > 0, kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    nucleus = [row for row, s in enumerate(specs) if s.top_p < 1.0]
    if nucleus:
        rows = torch.tensor(nucleus, device=device)
        top_p = torch.tensor([specs[row].top_p for row in nucleus], device=device)
        x[rows] = _nucleus(x[rows], top_p)
    return torch.softmax(x, dim=-1)


def _nucleus(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x: [r, vocab] scaled logits, top_p: [r] -> x with -inf past each row's top-p mass."""
    sorted_x, order = torch.sort(x, dim=1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    # drop a token when the mass before it already reaches top_p (the first always stays)
    drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def draw(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """For each row of probs ([m, vocab]), the token whose share of the cumulative distribution
    holds that row's u ([m] float64); a token of probability 0 never comes out."""
    cdf = torch.cumsum(probs.double(), dim=1)  # float64: the same boundaries at any batch
    index = torch.searchsorted(cdf, (cdf[:, -1] * u)[:, None], right=True)  # [m, 1]
    return index.clamp(max=probs.shape[1] - 1).flatten().tolist()


def sample(logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int]) -> list[int]:
    """logits: [n, vocab] float32, one row per sequence; positions: where each sampled token
    goes in its sequence -> n token ids."""
    tokens = greedy_tokens(logits)
    sampled = [row for row, spec in enumerate(specs) if not spec.greedy]
    if not sampled:
        return tokens
    if len(sampled) < len(specs):
        logits = logits.index_select(0, torch.tensor(sampled, device=logits.device))
    probs = filtered_rows(logits, [specs[row] for row in sampled])
    u = [uniform(specs[row].seed, positions[row]) for row in sampled]
    drawn = draw(probs, torch.tensor(u, dtype=torch.float64, device=logits.device))
    for row, token in zip(sampled, drawn, strict=True):
        tokens[row] = token
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
