"""The LM head's float32 logits near each row's maximum (stage_worker/layers/exact_logits.py): a
bf16 head rounds its output to bf16 steps, turning near-ties into exact ties that argmax breaks
by vocabulary index; the head must pick what the float32 product picks."""

from __future__ import annotations

import pytest
import torch

from stage_worker.comm import TPGroup
from stage_worker.layers import ParallelLMHead, VocabParallelEmbedding, exact_logits


def _near_tie(hidden_size: int = 64, vocab: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 head and input where tokens 7 and 250 are 0.02 apart near 10 (bf16 steps there
    are 0.0625, so both round to 10.0) and token 7 comes first: [vocab, H], [1, H]."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.01).to(torch.bfloat16)
    hidden = torch.zeros(1, hidden_size, dtype=torch.bfloat16)
    hidden[0, 0] = 1.0
    weight[:, 0] = torch.linspace(-2, 2, vocab).to(torch.bfloat16)  # every other logit far below
    weight[7, 0], weight[250, 0] = 10.0, 10.0
    hidden[0, 1] = 0.125
    weight[7, 1], weight[250, 1] = 0.0, 0.15625  # exact: 10.0 and 10.01953125
    return weight, hidden


def test_rounding_alone_makes_the_tie_the_head_must_break_right() -> None:
    weight, hidden = _near_tie()
    rounded = (hidden @ weight.T).float()
    exact = hidden.float() @ weight.float().T
    assert rounded[0, 7] == rounded[0, 250]  # the tie bf16 output makes
    assert int(rounded.argmax()) == 7 and int(exact.argmax()) == 250
    refined = exact_logits.refine(rounded.clone(), hidden, weight)
    assert int(refined.argmax()) == 250
    assert refined[0, 250] == exact[0, 250] and refined[0, 7] == exact[0, 7]


@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_head_returns_the_float32_argmax(tied: bool) -> None:
    weight, hidden = _near_tie()
    head = ParallelLMHead(weight.shape[0], weight.shape[1], TPGroup(), "cpu", torch.bfloat16)
    head.weight.data.copy_(weight)
    embedding = None
    if tied:
        embedding = VocabParallelEmbedding(*weight.shape, TPGroup(), "cpu", torch.bfloat16)
        embedding.weight = head.weight
    head.pack(embedding)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    assert int(logits.argmax()) == 250
    torch.testing.assert_close(logits[0, 250], (hidden.float() @ weight.float().T)[0, 250])


def test_values_outside_the_band_keep_their_rounding_and_inside_are_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(1000, 32, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    rounded = (hidden @ weight.T).float()
    exact = hidden.float() @ weight.float().T
    refined = exact_logits.refine(rounded.clone(), hidden, weight)
    assert torch.equal(refined.argmax(dim=1), exact.argmax(dim=1))
    changed = refined != rounded
    best = rounded.amax(dim=1, keepdim=True)
    band = rounded >= best - 2 * exact_logits.step_at(best, torch.bfloat16)
    assert not (changed & ~band).any()
    torch.testing.assert_close(refined[band], exact[band])


def test_a_float32_head_is_left_alone() -> None:
    head = ParallelLMHead(10, 8, TPGroup(), "cpu", torch.float32)
    head.pack(None)
    assert head.rows is None
