"""Logit adjustments of one sequence on the last stage: OpenAI's presence and frequency
penalties, vLLM's repetition penalty, logit bias and min_tokens.

Counts live in a dense [vocab] tensor per sequence, updated by one element per sampled token, so
a step's work is O(vocab) whatever the context length. The last stage learns the tokens so far
once, when the sequence (re)starts (a recompute or a resumed stream), and counts what it samples
from then on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sarathi_proto import stage_pb2


@dataclass(frozen=True)
class PenaltySpec:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias_token_ids: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_proto(cls, p: stage_pb2.SamplingParams) -> PenaltySpec:
        return cls(
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty or 1.0,
            tuple(p.logit_bias_token_ids),
            tuple(p.logit_bias_values),
            p.min_tokens,
            tuple(p.stop_token_ids),
        )

    @property
    def active(self) -> bool:
        return bool(
            self.presence or self.frequency or self.repetition != 1.0 or self.bias_token_ids
            or self.min_tokens
        )  # fmt: skip


class PenaltyState:
    """A sequence's output counts [vocab] and prompt tokens [vocab] (a mask), on the device."""

    def __init__(
        self,
        spec: PenaltySpec,
        vocab_size: int,
        device: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
    ) -> None:
        self.spec = spec
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if output_token_ids:
            ids = torch.tensor(output_token_ids, dtype=torch.int64, device=device)
            self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        self.num_outputs = len(output_token_ids)
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if spec.repetition != 1.0 and prompt_token_ids:
            self.in_prompt[torch.tensor(prompt_token_ids, dtype=torch.int64, device=device)] = True
        self._bias = None
        if spec.bias_token_ids:
            self._bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            ids = torch.tensor(spec.bias_token_ids, dtype=torch.int64, device=device)
            self._bias.index_put_((ids,), torch.tensor(spec.bias_values, device=device))
        self._stops = torch.tensor(spec.stop_token_ids, dtype=torch.int64, device=device)

    def apply(self, logits: torch.Tensor) -> None:
        """logits: [vocab] float32, adjusted in place (the order vLLM applies them in)."""
        spec = self.spec
        if self.num_outputs < spec.min_tokens and self._stops.numel():
            logits.index_fill_(0, self._stops, float("-inf"))
        if self._bias is not None:
            logits += self._bias
        if spec.repetition != 1.0:
            seen = self.in_prompt | (self.counts > 0)
            scaled = torch.where(logits > 0, logits / spec.repetition, logits * spec.repetition)
            logits.copy_(torch.where(seen, scaled, logits))
        if spec.frequency:
            logits -= spec.frequency * self.counts
        if spec.presence:
            logits -= spec.presence * (self.counts > 0).float()

    def observe(self, token_id: int) -> None:
        """The token this sequence just sampled."""
        self.counts[token_id] += 1.0
        self.num_outputs += 1


def adjusted(logits: torch.Tensor, states: list[PenaltyState | None]) -> torch.Tensor:
    """logits: [n, vocab] float32 -> the logits to sample from: a copy with each row's
    adjustments where any row has them, else logits itself (no copy)."""
    if all(state is None for state in states):
        return logits
    out = logits.clone()
    for row, state in enumerate(states):
        if state is not None:
            state.apply(out[row])
    return out
