"""Sampling as a user sees it: greedy picks the top token, a seed replays the same tokens, top-k
and top-p never return a token outside their set."""

from __future__ import annotations

import torch

from stage_worker.sampler import SamplingSpec, filtered_probs, make_generator, sample


def make_logits(vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw(spec: SamplingSpec, logits: torch.Tensor, n: int) -> list[int]:
    """n tokens from one sequence's generator, one draw per step, as the last stage does."""
    gen = make_generator(spec.seed, "cpu")
    return [sample(logits[None], [spec], [gen])[0] for _ in range(n)]


def test_greedy_returns_the_argmax_of_each_row() -> None:
    logits = torch.stack([make_logits(seed=s) for s in range(4)])
    specs = [SamplingSpec()] * 4
    gens = [make_generator(0, "cpu") for _ in range(4)]
    assert sample(logits, specs, gens) == logits.argmax(dim=-1).tolist()


def test_same_seed_gives_the_same_tokens_and_another_seed_differs() -> None:
    logits = make_logits()
    spec = SamplingSpec(temperature=1.5, seed=1234)
    assert draw(spec, logits, 30) == draw(spec, logits, 30)
    assert draw(spec, logits, 30) != draw(SamplingSpec(temperature=1.5, seed=99), logits, 30)


def test_a_sequence_draws_the_same_whatever_shares_its_batch() -> None:
    logits = make_logits()
    spec = SamplingSpec(temperature=1.0, seed=7)
    alone = draw(spec, logits, 10)
    gen, other_gen = make_generator(7, "cpu"), make_generator(8, "cpu")
    other = SamplingSpec(temperature=1.0, seed=8)
    shared = [
        sample(torch.stack([make_logits(seed=5), logits]), [other, spec], [other_gen, gen])[1]
        for _ in range(10)
    ]
    assert shared == alone


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
