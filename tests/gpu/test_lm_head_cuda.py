"""The LM head on CUDA in bf16 hands back float32 logits that were never rounded to bf16: within
float32 summation error of a float64 reference, so near-ties are not made exact ties (the CPU
head refines its top logits for the same reason: layers/exact_logits.py)."""

from __future__ import annotations

import pytest
import torch

from stage_worker.comm import TPGroup
from stage_worker.layers import ParallelLMHead

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_bf16_head_logits_are_float32_sums() -> None:
    vocab, hidden = 32000, 4096
    gen = torch.Generator(device="cuda").manual_seed(3)
    head = ParallelLMHead(vocab, hidden, TPGroup(), "cuda", torch.bfloat16)
    head.weight.data.copy_(torch.randn(vocab, hidden, generator=gen, device="cuda") * 0.02)
    head.pack(None)
    x = (torch.randn(5, hidden, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    logits = head(x)
    exact = x.double() @ head.weight.double().t()
    assert logits.dtype == torch.float32 and logits.shape == (5, vocab)
    torch.testing.assert_close(logits.double(), exact, atol=1e-4, rtol=1e-5)
    # bf16 rounding would have moved them by up to half a bf16 step (about 2e-2 at 4-8)
    assert not torch.equal(logits, logits.to(torch.bfloat16).float())
