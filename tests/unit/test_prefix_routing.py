"""The endpoint picker's model (bench/endpoint_picker.py), the routing policies and the chat
sessions that `sarathictl bench prefix-routing` measures with."""

from __future__ import annotations

import json
import random

import pytest
from sarathictl.bench.chat_sessions import ChatWorkload, chat_sessions
from sarathictl.bench.endpoint_picker import (
    BLOCK_CHARS,
    CHART_WEIGHTS,
    EndpointLoad,
    PrefixIndex,
    Weights,
    pick,
    prompt_block_hashes,
    queue_scores,
)
from sarathictl.bench.routing_policies import Router, parse_policy
from sarathictl.bench.routing_results import PREFIX_COUNTERS, Turn, summarize

IDLE = EndpointLoad(waiting=0, kv_cache_usage=0.1)


def test_block_hashes_are_chained_full_blocks() -> None:
    a = "x" * (2 * BLOCK_CHARS) + "a" * BLOCK_CHARS + "tail"
    b = "x" * (2 * BLOCK_CHARS) + "b" * BLOCK_CHARS
    ha, hb = prompt_block_hashes("m", a), prompt_block_hashes("m", b)
    assert len(ha) == 3  # the partial "tail" is not hashed
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert ha[0] != ha[1]  # chained: the same characters in another place hash differently
    assert prompt_block_hashes("other-model", a)[0] != ha[0]
    assert len(prompt_block_hashes("m", a, max_blocks=2)) == 2


def test_index_matches_leading_blocks_and_forgets_least_recent() -> None:
    index = PrefixIndex(capacity_per_endpoint=3)
    index.add([b"1", b"2", b"3"], "e0")
    assert index.matched_blocks([b"1", b"2", b"9", b"3"], "e0") == 2
    assert index.matched_blocks([b"1"], "e1") == 0
    index.add([b"4"], "e0")  # "1" is the least recently added: it goes
    assert index.matched_blocks([b"1", b"2"], "e0") == 0
    assert index.matched_blocks([b"2", b"3", b"4"], "e0") == 3


def test_queue_scores_scale_between_fewest_and_most_waiting() -> None:
    assert queue_scores({"a": IDLE, "b": IDLE}) == {"a": 1.0, "b": 1.0}
    loads = {e: EndpointLoad(w, 0.0) for e, w in (("a", 0), ("b", 2), ("c", 4))}
    assert queue_scores(loads) == {"a": 1.0, "b": 0.5, "c": 0.0}


def test_next_turn_goes_where_the_conversation_was_when_loads_are_equal() -> None:
    index, rng = PrefixIndex(), random.Random(0)
    loads = {"e0": IDLE, "e1": IDLE}
    first = "s" * 4 * BLOCK_CHARS
    picks = {pick(prompt_block_hashes("m", first), loads, index, CHART_WEIGHTS, rng)}
    for turn in range(1, 6):
        prompt = first + "t" * turn * BLOCK_CHARS
        picks.add(pick(prompt_block_hashes("m", prompt), loads, index, CHART_WEIGHTS, rng))
    assert len(picks) == 1


def test_chart_weights_let_a_shorter_queue_outweigh_the_whole_prefix() -> None:
    """The trade the chart's 2:2:1 makes: one request waiting more on the holder of a
    conversation sends its next turn elsewhere; a prefix weight of 4 keeps it."""
    prompt = prompt_block_hashes("m", "p" * 8 * BLOCK_CHARS)
    busier_holder = {"e0": EndpointLoad(1, 0.1), "e1": IDLE}
    for weights, expected in ((CHART_WEIGHTS, "e1"), (Weights(2, 2, 4), "e0")):
        index = PrefixIndex()
        index.add(prompt, "e0")
        assert pick(prompt, busier_holder, index, weights, random.Random(0)) == expected


def test_policies_by_name() -> None:
    assert parse_policy("epp").weights == CHART_WEIGHTS
    assert parse_policy("load").weights == Weights(2, 2, 0)
    assert parse_policy("epp:1,0.5,3").weights == Weights(1, 0.5, 3)
    assert parse_policy("round-robin").weights is None
    with pytest.raises(ValueError, match="must be single, round-robin"):
        parse_policy("random")
    with pytest.raises(ValueError, match="must be epp:Q,K,P, three weights"):
        parse_policy("epp:1,2")
    with pytest.raises(ValueError, match="prefix weight must be >= 0"):
        parse_policy("epp:1,1,-1")


def test_simple_routers() -> None:
    endpoints = ["e0", "e1"]
    rr = Router(parse_policy("round-robin"), endpoints, "m", seed=0)
    assert [rr.route("p", {}) for _ in range(4)] == ["e0", "e1", "e0", "e1"]
    single = Router(parse_policy("single"), endpoints, "m", seed=0)
    assert {single.route("p", {}) for _ in range(4)} == {"e0"}


def test_sessions_resend_their_history_and_runs_share_no_text() -> None:
    workload = ChatWorkload(sessions=2, turns=3, system_words=10, question_words=5)
    sessions = chat_sessions(workload, seed=1)
    assert sessions[0].system_prompt == sessions[1].system_prompt
    first = json.dumps(sessions[0].next_messages(), separators=(",", ":"))
    sessions[0].answered("an answer")
    second = json.dumps(sessions[0].next_messages(), separators=(",", ":"))
    assert second.startswith(first[:-1])  # what the picker hashes: the last turn's prompt
    assert sessions[0].messages[-1]["content"] != sessions[1].next_messages()[-1]["content"]
    other = chat_sessions(workload, seed=2)
    assert other[0].system_prompt.split()[1:3] != sessions[0].system_prompt.split()[1:3]
    with pytest.raises(ValueError, match="turns must be >= 1"):
        ChatWorkload(turns=0)


def test_summary_counts_hits_and_returns_to_the_same_pipeline() -> None:
    turns = [
        Turn(0, 0, "e0", 0.1, 10), Turn(0, 1, "e0", 0.2, 20), Turn(0, 2, "e1", 0.3, 30),
        Turn(1, 0, "e1", 0.4, 10), Turn(1, 1, "e1", 0.5, 20),
    ]  # fmt: skip
    # queries, hits, query requests, hit requests, evictions: e0 moved, e1 moved 100 each
    before = [dict.fromkeys(PREFIX_COUNTERS, 5.0), dict.fromkeys(PREFIX_COUNTERS, 0.0)]
    after = [
        dict(zip(PREFIX_COUNTERS, (105.0, 65.0, 8.0, 7.0, 9.0), strict=True)),
        dict.fromkeys(PREFIX_COUNTERS, 100.0),
    ]
    result = summarize("rr", turns, 0, ["e0", "e1"], before, after, wall_s=3.0)
    assert (result.prompt_tokens, result.cached_tokens) == (200, 160)
    assert result.token_hit_rate == 0.8
    assert (result.requests_admitted, result.requests_hit) == (103, 102)
    assert result.evicted_blocks == 4 + 100
    assert (result.later_turns, result.later_turns_same_pipeline) == (3, 2)
    assert result.requests_per_pipeline == [2, 3]
    assert result.ttft_median_s == 0.3
