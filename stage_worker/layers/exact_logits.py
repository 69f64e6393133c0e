"""Float32 logits where they decide a greedy answer, from an LM head that runs in bf16.

The head's matmul sums in float32, but a bf16 matmul hands its output back rounded to bf16: at
logits of 8 to 32 the steps are 0.0625 to 0.25 apart, so near-ties become exact ties, and
argmax breaks them by vocabulary index (the demo once answered the France question with
"L'Étoile" over "The": both at -1.993 after rounding, 0.25 apart before). torch has no CPU
matmul from bf16 inputs to a float32 output, and a float32 copy of the head would double the
bytes it reads every decode step, so the head runs in the model dtype and then every logit
within two steps of its row's maximum is recomputed exactly: float32 dot products of the same
bf16 weight rows (usually a handful per row). Why that settles argmax: a rounded logit lies
within half a step of the exact one, so the exact maximum is among those within a step of the
rounded maximum, and everything outside the band is below it. The rest of the row keeps its
rounding (a sampled tail, log-probabilities below the top), as in transformers and vLLM.

Where the CPU has AVX-512 with bf16, a head scoring up to matmul_bf16.REACH.max_tokens rows (a
decode step's, where the kernel is the faster) runs the package's kernel, which hands its
float32 sums back unrounded: those logits need nothing from here (embedding.py).
"""

from __future__ import annotations

import torch

_BLOCK = 64
"""Logits per block in the search for the band: whole rows compared and gathered took 3 ms at a
batch of 32 over SmolLM2's 49,152 tokens; each block's maximum first, then the few blocks that
reach the band, takes a tenth of that."""


def step_at(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of dtype's numbers at each of values (float32) -> the same shape."""
    _, exponent = torch.frexp(values)  # values = mantissa * 2**exponent, |mantissa| in [0.5, 1)
    return torch.finfo(dtype).eps * torch.pow(2.0, exponent.float() - 1)


def refine(logits: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits: [n, V] float32, the head's output rounded to rows.dtype; hidden: [n, H], the
    head's input; rows: [V, H], its weight, plain -> logits with every value within two steps
    of its row's maximum exact (in place)."""
    best = logits.amax(dim=1, keepdim=True)  # [n, 1]
    row, col = _at_least(logits, best - 2 * step_at(best, rows.dtype))  # [m] each
    exact = (rows[col].float() * hidden[row].float()).sum(dim=1)  # [m]
    logits[row, col] = exact
    return logits


def _at_least(logits: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [n, V], floor: [n, 1] -> (rows, columns) of the logits >= their row's floor."""
    n, vocab = logits.shape
    whole = vocab - vocab % _BLOCK
    blocks = logits[:, :whole].view(n, whole // _BLOCK, _BLOCK)  # [n, V / 64, 64]
    hit_row, hit_block = (blocks.amax(dim=2) >= floor).nonzero(as_tuple=True)  # [h] each
    hit, offset = (blocks[hit_row, hit_block] >= floor[hit_row]).nonzero(as_tuple=True)
    tail_row, tail_col = (logits[:, whole:] >= floor).nonzero(as_tuple=True)
    rows = torch.cat([hit_row[hit], tail_row])
    return rows, torch.cat([hit_block[hit] * _BLOCK + offset, tail_col + whole])
