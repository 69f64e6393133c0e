"""Decodes that go ahead of their input token (SchedulerConfig.decode_ahead, PP = 1): the stage
feeds each the token it sampled last, so the tokens are the ones the plain order gives, for
greedy, seeded sampling, penalties and a stop token; a stage that cannot have that token
refuses such a plan, changing nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from sarathi_proto import stage_pb2

from controller.scheduler import SamplingParams
from stage_worker.errors import PlanError
from tests.unit.stage_worker.inprocess import generate, make_runners
from tests.unit.stage_worker.test_matches_transformers import make_prompts
from tests.unit.stage_worker.tiny_models import load_oracle, oracle_greedy

PROMPT_LENGTHS = (37, 5, 70, 16, 2)
MAX_TOKENS = 9


@pytest.mark.parametrize("vector_decodes_from", [1, 1 << 30], ids=["columns", "chunks"])
def test_decodes_ahead_give_transformers_greedy_tokens(
    vector_decodes_from: int, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = tiny_checkpoint("llama")
    prompts = make_prompts(PROMPT_LENGTHS)
    out = generate(
        make_runners(model_dir, 1, num_blocks=64), prompts, MAX_TOKENS,
        vector_decodes_from=vector_decodes_from, decode_ahead=True,
    )  # fmt: skip
    oracle = load_oracle(model_dir)
    for seq_id, prompt in enumerate(prompts):
        assert out.tokens[seq_id] == oracle_greedy(oracle, prompt, MAX_TOKENS), seq_id
    # Most decodes went ahead: all but each sequence's first and those its last token stops.
    assert out.num_ahead >= len(prompts) * (MAX_TOKENS - 3)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1000),
        SamplingParams(temperature=0.7, seed=5, presence_penalty=1.5, repetition_penalty=1.3),
    ],
    ids=["seeded", "penalties"],
)
def test_sampled_tokens_are_the_plain_orders(
    sampling: SamplingParams, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = tiny_checkpoint("llama")
    prompts = make_prompts(PROMPT_LENGTHS)
    runs = [
        generate(
            make_runners(model_dir, 1, num_blocks=64),
            prompts,
            17,
            sampling=sampling,
            decode_ahead=ahead,
        )
        for ahead in (False, True)
    ]
    assert runs[1].num_ahead > 0
    assert runs[1].tokens == runs[0].tokens


def test_a_stop_token_ends_the_stream_where_the_plain_order_does(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """The decode that went ahead of a stop token is computed and its token dropped."""
    model_dir = tiny_checkpoint("llama")
    prompts = make_prompts(PROMPT_LENGTHS)
    plain = generate(make_runners(model_dir, 1, num_blocks=64), prompts, MAX_TOKENS)
    stop = frozenset({plain.tokens[0][3]})  # sequence 0's fourth token
    runs = [
        generate(
            make_runners(model_dir, 1, num_blocks=64),
            prompts,
            MAX_TOKENS,
            stop_token_ids=stop,
            decode_ahead=ahead,
        )
        for ahead in (False, True)
    ]
    assert runs[1].tokens == runs[0].tokens
    assert len(runs[1].tokens[0]) == 4


def ahead_plan(batch_id: int, position: int, columns: bool) -> stage_pb2.StepPlan:
    """Sequence 1's decode at position, ahead of its input token, as a chunk or in columns."""
    plan = stage_pb2.StepPlan(batch_id=batch_id)
    if columns:
        plan.decodes.seq_ids.append(1)
        plan.decodes.positions.append(position)
        plan.decodes.token_ids.append(0)
        plan.decodes.ahead_at.append(0)
    else:
        plan.seqs.add(
            seq_id=1, first_position=position, num_tokens=1, yields_token=True, ahead=True
        )
    return plan


@pytest.mark.parametrize("columns", [False, True], ids=["chunk", "columns"])
def test_a_decode_ahead_is_refused_where_the_stage_has_no_token_for_it(
    columns: bool, tiny_checkpoint: Callable[[str], Path]
) -> None:
    runner = make_runners(tiny_checkpoint("llama"), 1, num_blocks=8)[0]
    first = stage_pb2.StepPlan(batch_id=1)
    first.seqs.add(
        seq_id=1, first_position=0, num_tokens=3, yields_token=True, new_block_ids=[0],
        token_ids=[5, 6, 7], sampling=stage_pb2.SamplingParams(temperature=0.0),
    )  # fmt: skip
    runner.prepare(first)  # its prompt computed, but no token sampled yet
    with pytest.raises(PlanError, match="no token sampled"):
        runner.prepare(ahead_plan(2, 3, columns))
    assert runner.seqs[1].num_computed_tokens == 3  # unchanged

    two_stages = make_runners(tiny_checkpoint("llama"), 2, num_blocks=8)
    for runner in two_stages:
        runner.prepare(first)
        runner.seqs[1].last_sampled = 9
    for runner in two_stages:
        with pytest.raises(PlanError, match="does not both embed and sample"):
            runner.prepare(ahead_plan(2, 3, columns))
