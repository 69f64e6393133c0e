"""Penalties, logit bias and min_tokens on the last stage: the adjustments against their
definitions, and through the in-process pipeline under the real scheduler (a preempted request
with penalties streams the same tokens as one that was not)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from controller.scheduler import SamplingParams
from stage_worker.penalties import PenaltySpec, PenaltyState, adjusted
from tests.unit.stage_worker.inprocess import generate, make_runners
from tests.unit.stage_worker.test_matches_transformers import make_prompts

VOCAB = 11


def reference(
    logits: torch.Tensor, spec: PenaltySpec, prompt: list[int], outputs: list[int]
) -> torch.Tensor:
    """The definitions, one token at a time (vLLM's order: min_tokens, bias, repetition,
    frequency, presence)."""
    out = logits.clone()
    for t in range(VOCAB):
        if len(outputs) < spec.min_tokens and t in spec.stop_token_ids:
            out[t] = float("-inf")
            continue
        for bias_id, bias in zip(spec.bias_token_ids, spec.bias_values, strict=True):
            if bias_id == t:
                out[t] += bias
        if t in prompt or t in outputs:
            out[t] = out[t] / spec.repetition if out[t] > 0 else out[t] * spec.repetition
        count = outputs.count(t)
        out[t] -= spec.frequency * count + spec.presence * (count > 0)
    return out


@pytest.mark.parametrize(
    "spec",
    [
        PenaltySpec(presence=0.7),
        PenaltySpec(frequency=-0.4),
        PenaltySpec(repetition=1.3),
        PenaltySpec(bias_token_ids=(2, 9), bias_values=(5.0, -100.0)),
        PenaltySpec(min_tokens=4, stop_token_ids=(0, 3)),
        PenaltySpec(0.5, 0.25, 0.8, (1,), (2.0,), 3, (7,)),
    ],
)
def test_each_adjustment_is_its_definition_and_counts_follow_the_samples(spec: PenaltySpec) -> None:
    torch.manual_seed(0)
    prompt, outputs = [1, 4, 4, 6], [2, 6]
    state = PenaltyState(spec, VOCAB, "cpu", prompt, outputs)
    for new_token in (6, 5, 9):
        logits = torch.randn(VOCAB) * 3
        row = logits.clone()
        state.apply(row)
        torch.testing.assert_close(row, reference(logits, spec, prompt, outputs))
        state.observe(new_token)
        outputs.append(new_token)


def test_rows_without_adjustments_are_not_copied() -> None:
    logits = torch.zeros(2, VOCAB)
    assert adjusted(logits, [None, None]) is logits
    state = PenaltyState(PenaltySpec(presence=1.0), VOCAB, "cpu", [], [3])
    out = adjusted(logits, [None, state])
    assert out is not logits and logits[1, 3] == 0.0 and out[1, 3] == -1.0
    assert torch.equal(out[0], logits[0])


def test_a_strong_logit_bias_and_min_tokens_decide_the_stream(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    model_dir = tiny_checkpoint("llama")
    prompts = make_prompts((9,))
    biased = SamplingParams(logit_bias=((17, 100.0),))
    out = generate(make_runners(model_dir, 2, num_blocks=64), prompts, 5, sampling=biased)
    assert out.tokens[0] == [17] * 5
    # 17 is now a stop token held back for 3 tokens: then it comes.
    held = generate_with_stops(model_dir, dataclasses.replace(biased, min_tokens=3), {17})
    assert held[:3] != [17] * 3 and 17 not in held[:3] and held[3] == 17


def generate_with_stops(model_dir: Path, sampling: SamplingParams, stops: set[int]) -> list[int]:
    """One request whose stop tokens are `stops` (the scheduler ends it after one of them)."""
    runners = make_runners(model_dir, 1, num_blocks=64)
    prompts = make_prompts((9,))
    out = generate(runners, prompts, 6, sampling=sampling, stop_token_ids=frozenset(stops))
    return out.tokens[0]


def test_penalties_survive_preemption_and_change_the_stream(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """The recomputed sequence's last stage gets its tokens so far again and counts from them:
    the streams of a run that preempts equal a run with room for all."""
    model_dir = tiny_checkpoint("llama")
    prompts = make_prompts((30, 29, 31))
    penalised = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2)
    tight = generate(make_runners(model_dir, 2, num_blocks=8), prompts, 33, sampling=penalised)
    roomy = generate(make_runners(model_dir, 2, num_blocks=64), prompts, 33, sampling=penalised)
    assert tight.num_preemptions > 0 and roomy.num_preemptions == 0
    assert tight.tokens == roomy.tokens
    plain = generate(make_runners(model_dir, 2, num_blocks=64), prompts, 33)
    assert roomy.tokens != plain.tokens  # the penalties do change the greedy choice
    # Fewer repeats: the most frequent token of each stream is rarer with the penalties.
    for seq_id in roomy.tokens:
        top = max(roomy.tokens[seq_id].count(t) for t in roomy.tokens[seq_id])
        assert top <= max(plain.tokens[seq_id].count(t) for t in plain.tokens[seq_id])
