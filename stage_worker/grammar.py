"""Structured output on the last stage: an llguidance matcher per constrained sequence masks
the tokens its grammar does not allow, before every sampled token.

The mask comes from the matcher as a bitmap (one bit per token, little-endian 32-bit words);
tokens past the tokenizer's vocabulary (an embedding padded to a round size) are never allowed.
"""

from __future__ import annotations

import json
import logging
from functools import cache
from pathlib import Path

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

logger = logging.getLogger(__name__)


@cache
def load_tokenizer(model_dir: str) -> LLTokenizer:
    """The model folder's tokenizer.json as llguidance's tokenizer, with the end-of-sequence
    ids of its config.json (built once per process: about a second for a large vocabulary)."""
    folder = Path(model_dir)
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    return LLTokenizer((folder / "tokenizer.json").read_text(), eos_token=eos)


class GrammarState:
    def __init__(self, tokenizer: LLTokenizer, grammar: str, output_token_ids: list[int]) -> None:
        self.matcher = LLMatcher(tokenizer, grammar)
        if output_token_ids and not self.matcher.consume_tokens(output_token_ids):
            logger.error("the resumed output does not match its grammar: %s", self.error)

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar allows next."""
        bits = np.unpackbits(
            np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little"
        )
        mask = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, bits.shape[0])
        mask[:n] = bits[:n].astype(bool)
        return torch.from_numpy(mask)

    def observe(self, token_id: int) -> None:
        """The token this sequence just sampled (always an allowed one)."""
        if not self.matcher.consume_token(token_id):
            logger.error("token %d refused by its grammar: %s", token_id, self.error)


def masked(
    logits: torch.Tensor, grammars: list[GrammarState | None], copy: bool = True
) -> torch.Tensor:
    """logits: [n, vocab] float32 -> each constrained row's disallowed tokens at -inf, in a copy
    (in logits itself when copy is False: a copy made already), or logits itself when no row is
    constrained."""
    if all(g is None for g in grammars):
        return logits
    out = logits.clone() if copy else logits
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            allowed = grammar.allowed(out.shape[1]).to(out.device)
            out[row].masked_fill_(~allowed, float("-inf"))
    return out
