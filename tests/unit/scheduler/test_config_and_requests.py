"""Bad configuration raises at construction naming the field; bad requests queue nothing."""

from __future__ import annotations

import pytest

from controller.scheduler import (
    CacheConfig,
    ConfigError,
    InvalidRequestError,
    RequestParams,
    SamplingParams,
    SchedulerConfig,
)
from tests.unit.scheduler.factories import FakePipeline, add_request, create_scheduler


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"budget_tokens": 0}, "budget_tokens"),
        ({"budget_tokens": -32}, "budget_tokens"),
        ({"budget_tokens": 100, "tile_tokens": 32}, "budget_tokens"),
        ({"tile_tokens": 3}, "tile_tokens"),
        ({"pipeline_depth": 0}, "pipeline_depth"),
        ({"policy": "fifo"}, "policy"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 1024, "budget_tokens": 512}, "max_num_seqs"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"chunk_schedule": ((1024, 256), (512, 128))}, "chunk_schedule"),
        ({"chunk_schedule": ((1024, 100),)}, "chunk_schedule"),
        ({"idle_budget_tokens": 256}, "idle_budget_tokens"),  # under the budget (512)
        ({"idle_budget_tokens": 1000}, "idle_budget_tokens"),  # not a multiple of the tile
        ({"idle_budget_tokens": 1024, "pipeline_depth": 2}, "idle_budget_tokens"),
        ({"idle_budget_tokens": 1024, "policy": "vllm"}, "idle_budget_tokens"),
    ],
)
def test_bad_scheduler_config_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 24}, "block_size"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"watermark": 1.0}, "watermark"),
    ],
)
def test_bad_cache_config_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        CacheConfig(**kwargs)  # type: ignore[arg-type]


def test_whole_prompt_policies_may_have_more_sequences_than_budget() -> None:
    # Only chunked policies need every decode to fit into one budget.
    assert SchedulerConfig(policy="vllm", max_num_seqs=1024, budget_tokens=512).max_num_seqs == 1024


def test_empty_prompt_is_refused_and_nothing_queued() -> None:
    sched = create_scheduler()
    with pytest.raises(InvalidRequestError) as err:
        sched.add_request(1, [], RequestParams(max_tokens=4), 0.0)
    assert err.value.field == "prompt"
    assert sched.num_waiting == 0 and not sched.has_unfinished


def test_prompt_plus_max_tokens_beyond_context_is_refused() -> None:
    sched = create_scheduler(max_model_len=100)
    with pytest.raises(InvalidRequestError, match="beyond the model's context of 100") as err:
        add_request(sched, 1, prompt_len=90, max_tokens=11)
    assert err.value.field == "max_tokens"
    add_request(sched, 2, prompt_len=90, max_tokens=10)  # exactly the context is fine
    assert sched.num_waiting == 1


def test_a_prompt_that_fills_the_context_is_refused_naming_the_prompt() -> None:
    """Whatever max_tokens is, the prompt alone leaves no room: the error names the prompt."""
    sched = create_scheduler(max_model_len=100)
    for prompt_len in (100, 101):
        with pytest.raises(InvalidRequestError, match="leave no room") as err:
            add_request(sched, prompt_len, prompt_len=prompt_len, max_tokens=1)
        assert err.value.field == "prompt"
    add_request(sched, 99, prompt_len=99, max_tokens=1)  # one token of room
    assert sched.num_waiting == 1


def test_max_tokens_below_one_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        add_request(create_scheduler(), 1, prompt_len=4, max_tokens=0)


def test_request_larger_than_the_whole_cache_is_refused() -> None:
    # It could never be admitted, so it would wait forever.
    sched = create_scheduler(num_blocks=4, block_size=16)
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        add_request(sched, 1, prompt_len=60, max_tokens=10)


def test_duplicate_running_id_is_refused() -> None:
    sched = create_scheduler()
    add_request(sched, 1, prompt_len=4, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="already running"):
        add_request(sched, 1, prompt_len=4, max_tokens=4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_unscheduled_counts_the_queued_and_the_admitted_before_their_first_chunk() -> None:
    """Status.num_unscheduled: each such sequence's scheduling delay is still growing (a live
    capacity probe stops on it, tools/sarathictl/bench/probe_verdict.py)."""
    sched = create_scheduler(budget_tokens=64, max_num_seqs=8)
    for seq_id in (1, 2, 3):
        add_request(sched, seq_id, prompt_len=100, max_tokens=2)
    assert sched.num_unscheduled == 3
    pipe = FakePipeline(sched)
    pipe.fill()  # 1's first 64 tokens
    assert sched.num_unscheduled == 2
    pipe.complete_oldest()
    pipe.fill()  # 1's last 36 and 2's first 28: only 3 is left
    assert sched.num_unscheduled == 1
    # A request with n = 2: its second sequence is admitted (holding KV blocks) as soon as the
    # first's prompt is scheduled whole, one micro-batch before it is scheduled itself.
    sched = create_scheduler(budget_tokens=64)
    params = [RequestParams(max_tokens=2, sampling=SamplingParams(seed=s)) for s in (1, 2)]
    sched.add_request_group([10, 11], list(range(5)), params, 0.0)
    pipe = FakePipeline(sched)
    pipe.fill()  # 10's prompt; 11 forks from it
    assert (sched.num_waiting, sched.num_running, sched.num_unscheduled) == (0, 2, 1)
    pipe.complete_oldest()
    pipe.fill()  # 11's last prompt token
    assert sched.num_unscheduled == 0
