"""Our stages, chained in one process under the real scheduler, against transformers: the same
greedy tokens and the same logits (float32, 1e-4) for every architecture and PP in {1, 2, 3}."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from controller.scheduler import SamplingParams
from tests.unit.stage_worker.inprocess import generate, make_runners
from tests.unit.stage_worker.tiny_models import (
    ARCHS,
    VOCAB_SIZE,
    load_oracle,
    oracle_greedy,
    oracle_last_logits,
)

# Lengths the budget of 32 does not divide, so prompts are chunked across micro-batches and
# chunks share micro-batches with other requests' decodes.
PROMPT_LENGTHS = (37, 5, 70)
MAX_TOKENS = 6


def make_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(7 * i + 3 * j + 1) % VOCAB_SIZE for j in range(n)] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_tokens_and_logits_match_transformers(
    arch: str, pp: int, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = tiny_checkpoint(arch)
    oracle = load_oracle(model_dir)
    prompts = make_prompts(PROMPT_LENGTHS)

    out = generate(make_runners(model_dir, pp, num_blocks=64), prompts, MAX_TOKENS)

    for seq_id, prompt in enumerate(prompts):
        expected = oracle_greedy(oracle, prompt, MAX_TOKENS)
        assert out.tokens[seq_id] == expected, f"sequence {seq_id} (prompt of {len(prompt)})"
        # logits at the prompt's end (a prefill chunk) and at the last decode
        first, last = out.last_logits[seq_id][0], out.last_logits[seq_id][-1]
        torch.testing.assert_close(first, oracle_last_logits(oracle, prompt), atol=1e-4, rtol=0)
        full = prompt + expected[:-1]
        torch.testing.assert_close(last, oracle_last_logits(oracle, full), atol=1e-4, rtol=0)


@pytest.mark.parametrize("pp", [1, 2])
def test_decodes_sent_as_packed_columns_give_the_same_tokens(
    pp: int, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Every decode of every micro-batch goes as StepPlan.decodes columns (the scheduler's
    threshold at 1), with prompt chunks on either side of them: the tokens stay transformers'."""
    model_dir = tiny_checkpoint("llama")
    prompts = make_prompts((37, 5, 70, 16, 2))
    runners = make_runners(model_dir, pp, num_blocks=64)
    out = generate(runners, prompts, MAX_TOKENS, vector_decodes_from=1)
    oracle = load_oracle(model_dir)
    for seq_id, prompt in enumerate(prompts):
        assert out.tokens[seq_id] == oracle_greedy(oracle, prompt, MAX_TOKENS), seq_id


@pytest.mark.parametrize("arch", ["llama", "falcon_new"])
def test_preempted_sequence_is_recomputed_to_the_same_tokens(
    arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = tiny_checkpoint(arch)
    prompts = make_prompts((30, 29, 31))
    max_tokens = 33
    # All three prompts fit (2 blocks of 16 each), but growing to 4 blocks each needs 12 of 8.
    out = generate(make_runners(model_dir, 2, num_blocks=8), prompts, max_tokens)

    assert out.num_preemptions > 0
    oracle = load_oracle(model_dir)
    for seq_id, prompt in enumerate(prompts):
        assert out.tokens[seq_id] == oracle_greedy(oracle, prompt, max_tokens)


def test_bfloat16_stage_agrees_with_float32_on_greedy_tokens(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    model_dir = tiny_checkpoint("llama")
    prompts = make_prompts((20,))
    f32 = generate(make_runners(model_dir, 1, num_blocks=16), prompts, 4)
    bf16 = generate(make_runners(model_dir, 1, num_blocks=16, dtype=torch.bfloat16), prompts, 4)
    # bf16 rounding may flip a later near-tie, but the first token of a peaked model holds
    assert bf16.tokens[0][0] == f32.tokens[0][0]
    torch.testing.assert_close(bf16.last_logits[0][0], f32.last_logits[0][0], atol=0.25, rtol=0.05)


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=1000)


@pytest.mark.parametrize("arch", ["llama", "falcon_new"])
def test_a_sampled_stream_survives_preemption_unchanged(
    arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Temperature 0.8, top-p 0.9: the streams of a run that preempts (8 blocks for 12 blocks'
    worth of sequences) equal those of a run with room for all, token for token."""
    model_dir = tiny_checkpoint(arch)
    prompts = make_prompts((30, 29, 31))
    tight = generate(make_runners(model_dir, 2, num_blocks=8), prompts, 33, sampling=SAMPLED)
    roomy = generate(make_runners(model_dir, 2, num_blocks=64), prompts, 33, sampling=SAMPLED)
    assert tight.num_preemptions > 0 and roomy.num_preemptions == 0
    assert tight.tokens == roomy.tokens
    greedy = generate(make_runners(model_dir, 2, num_blocks=64), prompts, 33)
    assert roomy.tokens != greedy.tokens  # it does sample


def test_the_same_seed_gives_the_same_stream_at_any_pipeline_depth(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    model_dir = tiny_checkpoint("falcon_mq")
    prompts = make_prompts(PROMPT_LENGTHS)
    runs = [
        generate(make_runners(model_dir, pp, num_blocks=64), prompts, 12, sampling=SAMPLED).tokens
        for pp in (1, 2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("pp", [1, 2])
def test_logprobs_are_transformers_log_softmax(
    pp: int, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Each token's log-probability and its top alternatives equal transformers' log_softmax at
    that position (float32, 1e-4), for a greedy and a sampled request (the model's own
    distribution: temperature and top-p do not change them)."""
    model_dir = tiny_checkpoint("llama")
    oracle = load_oracle(model_dir)
    prompts = make_prompts((37, 5))
    for sampling in (
        SamplingParams(top_logprobs=5),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, top_logprobs=3),
    ):
        out = generate(make_runners(model_dir, pp, num_blocks=64), prompts, 4, sampling=sampling)
        for seq_id, prompt in enumerate(prompts):
            tokens = out.tokens[seq_id]
            for i, entry in enumerate(out.logprobs[seq_id]):
                assert entry is not None
                expected = torch.log_softmax(oracle_last_logits(oracle, prompt + tokens[:i]), -1)
                assert entry.logprob == pytest.approx(float(expected[tokens[i]]), abs=1e-4)
                top = torch.topk(expected, sampling.top_logprobs or 0)
                assert entry.top_token_ids == top.indices.tolist()
                assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


def test_no_logprobs_unless_asked(tiny_checkpoint: Callable[[str], Path]) -> None:
    model_dir = tiny_checkpoint("llama")
    out = generate(make_runners(model_dir, 1, num_blocks=64), make_prompts((5,)), 3)
    assert out.logprobs[0] == [None, None, None]


@pytest.mark.parametrize("pp", [1, 2])
def test_prompt_logprobs_are_transformers_log_softmax_across_chunks(
    pp: int, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Prompts of 37 and 70 tokens go in chunks of at most 32: every prompt token from the
    second on is scored once, equal to transformers' log_softmax at the position before it."""
    model_dir = tiny_checkpoint("llama")
    oracle = load_oracle(model_dir)
    prompts = make_prompts((37, 70, 5))
    sampling = SamplingParams(prompt_logprobs=2)
    out = generate(make_runners(model_dir, pp, num_blocks=64), prompts, 2, sampling=sampling)
    for seq_id, prompt in enumerate(prompts):
        scored = out.prompt_logprobs[seq_id]
        assert sorted(scored) == list(range(1, len(prompt)))
        with torch.no_grad():
            logits = oracle(torch.tensor([prompt])).logits[0, :-1].float()
        expected = torch.log_softmax(logits, dim=-1)  # row i predicts prompt[i + 1]
        for position, entry in scored.items():
            row = expected[position - 1]
            assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
            assert entry.top_token_ids == torch.topk(row, 2).indices.tolist()
