"""The sampler on CUDA: the same filtering as on the CPU, seeded draws that repeat, and draws
that follow the filtered distribution."""

from __future__ import annotations

import pytest
import torch

from stage_worker.sampler import SamplingSpec, filtered_probs, make_generator, sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def logits(vocab: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    "spec",
    [SamplingSpec(0.7), SamplingSpec(1.0, top_k=20), SamplingSpec(0.8, top_p=0.9),
     SamplingSpec(1.3, top_p=0.5, top_k=50)],
)  # fmt: skip
def test_filtered_probs_on_cuda_equal_the_cpu(spec: SamplingSpec) -> None:
    x = logits()
    torch.testing.assert_close(
        filtered_probs(x.cuda(), spec).cpu(), filtered_probs(x, spec), atol=1e-6, rtol=1e-5
    )


def test_a_seed_repeats_its_tokens_on_cuda_whatever_shares_the_batch() -> None:
    rows = torch.stack([logits(seed=i) for i in range(4)]).cuda()
    spec = SamplingSpec(0.9, top_p=0.95, seed=7)

    def draw(batch: torch.Tensor, steps: int = 20) -> list[int]:
        gens = [make_generator(spec.seed, "cuda") for _ in range(batch.shape[0])]
        return [sample(batch, [spec] * batch.shape[0], gens)[0] for _ in range(steps)]

    alone = draw(rows[:1])
    assert draw(rows) == alone  # the first row's stream does not depend on the others
    assert len(set(alone)) > 1  # and it is sampled, not greedy
    greedy = sample(rows, [SamplingSpec()] * 4, [make_generator(0, "cuda")] * 4)
    top1 = sample(rows, [SamplingSpec(1.0, top_k=1)] * 4, [make_generator(1, "cuda")] * 4)
    assert greedy == top1 == rows.argmax(-1).tolist()


def test_cuda_draws_follow_the_filtered_distribution() -> None:
    x = logits(vocab=8, seed=3).cuda()
    spec = SamplingSpec(1.0, top_k=5)
    probs = filtered_probs(x, spec)
    gen = make_generator(11, "cuda")
    n = 20_000
    draws = torch.multinomial(probs, n, replacement=True, generator=gen)
    freq = torch.bincount(draws, minlength=8).float() / n
    assert (freq[probs == 0] == 0).all()  # nothing outside the top 5
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)  # ~4 standard deviations
