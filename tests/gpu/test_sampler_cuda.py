"""The sampler on CUDA: the same filtering as on the CPU, seeded draws that repeat, and draws
that follow the filtered distribution."""

from __future__ import annotations

import pytest
import torch

from stage_worker.sampler import SamplingSpec, filtered_probs, sample

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


def test_cuda_draws_equal_the_cpu_draws_for_a_seed() -> None:
    """A draw depends on (seed, position) and the probabilities alone: the GPU's tokens are the
    CPU's, whatever shares the batch."""
    rows = torch.stack([logits(seed=i) for i in range(4)])
    spec = SamplingSpec(0.9, top_p=0.95, seed=7)
    for position in range(20):
        positions = [position, 3, 9, 1]
        on_cuda = sample(rows.cuda(), [spec] * 4, positions)
        assert on_cuda == sample(rows, [spec] * 4, positions)
        assert on_cuda[0] == sample(rows[:1].cuda(), [spec], [position])[0]
    greedy = sample(rows.cuda(), [SamplingSpec()] * 4, [0] * 4)
    top1 = sample(rows.cuda(), [SamplingSpec(1.0, top_k=1)] * 4, [5] * 4)
    assert greedy == top1 == rows.argmax(-1).tolist()


def test_cuda_draws_follow_the_filtered_distribution() -> None:
    x = logits(vocab=8, seed=3).cuda()
    spec = SamplingSpec(1.0, top_k=5, seed=11)
    probs = filtered_probs(x, spec)
    n = 20_000
    tokens = torch.tensor([sample(x[None], [spec], [i])[0] for i in range(n)])
    freq = torch.bincount(tokens, minlength=8).float() / n
    assert (freq[probs.cpu() == 0] == 0).all()  # nothing outside the top 5
    torch.testing.assert_close(freq, probs.cpu(), atol=0.015, rtol=0)  # ~4 standard deviations
