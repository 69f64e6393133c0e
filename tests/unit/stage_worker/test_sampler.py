"""Sampling as a user sees it: greedy picks the top token, a seed replays the same tokens (a
token's draw depends on the seed and its position alone), the draws follow the distribution, and
top-k and top-p never return a token outside their set."""

from __future__ import annotations

import torch

from stage_worker.sampler import SamplingSpec, filtered_probs, greedy_tokens, sample, uniform


def make_logits(vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw(spec: SamplingSpec, logits: torch.Tensor, n: int, first: int = 0) -> list[int]:
    """The tokens at positions first .. first + n - 1 of one sequence, one step each."""
    return [sample(logits[None], [spec], [first + i])[0] for i in range(n)]


def test_greedy_returns_the_argmax_of_each_row() -> None:
    logits = torch.stack([make_logits(seed=s) for s in range(4)])
    specs = [SamplingSpec()] * 4
    assert sample(logits, specs, [0, 5, 9, 2]) == logits.argmax(dim=-1).tolist()


def test_same_seed_gives_the_same_tokens_and_another_seed_differs() -> None:
    logits = make_logits()
    spec = SamplingSpec(temperature=1.5, seed=1234)
    assert draw(spec, logits, 30) == draw(spec, logits, 30)
    assert draw(spec, logits, 30) != draw(SamplingSpec(temperature=1.5, seed=99), logits, 30)


def test_a_sequence_draws_the_same_whatever_shares_its_batch() -> None:
    logits = make_logits()
    spec = SamplingSpec(temperature=1.0, seed=7)
    alone = draw(spec, logits, 10)
    other = SamplingSpec(temperature=1.0, seed=8)
    shared = [
        sample(torch.stack([make_logits(seed=5), logits]), [other, spec], [100 + i, i])[1]
        for i in range(10)
    ]
    assert shared == alone


def test_a_recomputed_token_is_the_same_token() -> None:
    """The draw at a position does not depend on the draws before it: a sequence recomputed
    after a preemption (or a rebuilt pipeline) samples position 17 as it did the first time."""
    logits = make_logits()
    spec = SamplingSpec(temperature=1.2, top_p=0.9, seed=2024)
    first_time = draw(spec, logits, 30)
    assert draw(spec, logits, 13, first=17) == first_time[17:]


def test_uniform_depends_on_seed_and_position_and_spreads_evenly() -> None:
    values = [uniform(42, i) for i in range(20_000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert uniform(42, 7) == values[7] and uniform(43, 7) != values[7]
    counts = torch.histc(torch.tensor(values), bins=10, min=0.0, max=1.0)
    assert ((counts - 2000).abs() < 200).all()  # about 4.5 standard deviations per bin


def test_draws_follow_the_filtered_distribution() -> None:
    logits = make_logits(vocab=8, seed=3)
    spec = SamplingSpec(temperature=1.0, top_k=5, seed=11)
    probs = filtered_probs(logits, spec)
    tokens = torch.tensor(draw(spec, logits, 20_000))
    freq = torch.bincount(tokens, minlength=8).float() / len(tokens)
    assert (freq[probs == 0] == 0).all()
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_top_k_only_returns_the_k_most_likely_tokens() -> None:
    logits = make_logits()
    top3 = set(torch.topk(logits, 3).indices.tolist())
    tokens = draw(SamplingSpec(temperature=5.0, top_k=3, seed=3), logits, 200)
    assert set(tokens) <= top3
    assert len(set(tokens)) > 1  # a high temperature does spread over the three


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, SamplingSpec(temperature=1.0, top_p=0.75))
    # 0.5 alone is short of 0.75; 0.5 + 0.3 reaches it, so exactly tokens 0 and 1 remain
    assert (probs > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(probs[:2].sum(), torch.tensor(1.0))


def test_tiny_top_p_is_greedy() -> None:
    logits = make_logits()
    tokens = draw(SamplingSpec(temperature=1.0, top_p=1e-6, seed=4), logits, 20)
    assert tokens == [int(logits.argmax())] * 20


def _one_row_at_a_time(logits: torch.Tensor, spec: SamplingSpec, position: int) -> int:
    """The sampler before it was batched (one row, one set of calls), kept as the reference."""
    x = logits / spec.temperature
    if 0 < spec.top_k < x.shape[0]:
        x = x.masked_fill(x < torch.topk(x, spec.top_k).values[-1], float("-inf"))
    if spec.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= spec.top_p
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), -1e999)
    cdf = torch.cumsum(torch.softmax(x, dim=-1).double(), dim=0)
    index = int(torch.searchsorted(cdf, cdf[-1] * uniform(spec.seed, position), right=True))
    return min(index, x.shape[0] - 1)


def test_a_batch_draws_what_each_row_draws_alone() -> None:
    """Every mix of greedy, temperature, top-k and top-p rows in one batch, against the
    one-row-at-a-time sampler: the same token for every row and position."""
    gen = torch.Generator().manual_seed(5)
    specs = [
        SamplingSpec(),
        SamplingSpec(temperature=0.7, seed=1),
        SamplingSpec(temperature=1.0, top_k=5, seed=2),
        SamplingSpec(temperature=1.3, top_p=0.8, seed=3),
        SamplingSpec(temperature=0.9, top_k=40, top_p=0.95, seed=4),
        SamplingSpec(temperature=2.0, top_k=1000, seed=5),  # k past the vocabulary: no top-k
        SamplingSpec(temperature=0.5, top_p=1e-6, seed=6),
    ]
    for step in range(40):
        logits = torch.randn(len(specs), 300, generator=gen) * 4
        positions = [step * 3 + row for row in range(len(specs))]
        want = [
            int(logits[row].argmax()) if spec.greedy
            else _one_row_at_a_time(logits[row], spec, positions[row])
            for row, spec in enumerate(specs)
        ]  # fmt: skip
        assert sample(logits, specs, positions) == want


def test_greedy_tokens_are_torch_argmax_ties_and_masks_included() -> None:
    """The blocked argmax takes each row's first maximum, as torch.argmax does: across and
    within blocks, on rows masked to -inf but for a few tokens (a grammar), at any vocabulary
    size (one not a multiple of the block is padded)."""
    gen = torch.Generator().manual_seed(9)
    for vocab in (64, 300, 49152, 32001):
        logits = torch.randn(6, vocab, generator=gen)
        logits[1] = 0.0  # all tied: the first
        logits[2, vocab // 2] = logits[2, -1] = 100.0  # tied across blocks
        logits[3] = float("-inf")
        logits[3, [vocab - 1, 5]] = 2.0  # a grammar's two allowed tokens
        logits[4] = float("-inf")  # nothing allowed: index 0, as torch says
        assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_tokens(torch.zeros(0, 300)) == []  # a step whose rows all sample nothing
