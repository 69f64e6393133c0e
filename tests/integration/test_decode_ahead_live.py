"""Decodes ahead of their tokens, live: `sarathictl up --local --pp 1 --tp 2 --decode-ahead`
(on a CPU `up` leaves them off unless asked), checked over gRPC against transformers and
against the same cluster with --no-decode-ahead. Both TP ranks sample, so both must feed the
same token to the next step."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest
from sarathi_proto import generate_pb2

from tests.integration.cluster_factories import make_tiny_served_model, oracle_greedy_many
from tests.integration.local_cluster import RunningCluster, generate, local_cluster

pytestmark = pytest.mark.integration

UP_ARGS = ["--pp", "1", "--tp", "2", "--budget", "64", "--kv-cache-mb", "16", "--dtype", "float32"]
PROMPTS = [[5, 17, 33, 80, 101, 7, 9], list(range(40, 140)), [250, 3, 3, 3], list(range(1, 70))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")


@pytest.fixture(scope="module", params=[True, False], ids=["ahead", "not-ahead"])
def cluster(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningCluster]:
    args = [*UP_ARGS, "--decode-ahead" if request.param else "--no-decode-ahead"]
    with local_cluster(model_dir, tmp_path_factory.mktemp("logs"), args) as running:
        yield running


def test_the_controller_says_whether_decodes_go_ahead(cluster: RunningCluster) -> None:
    ahead = "--decode-ahead" in cluster.proc.args  # type: ignore[operator]
    log = (cluster.log_dir / "controller.log").read_text()
    assert f"decodes ahead={'on' if ahead else 'off'}" in log


def test_outputs_equal_the_transformers_oracle_with_requests_in_flight(
    cluster: RunningCluster,
) -> None:
    max_tokens = 12
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = list(
            pool.map(
                lambda p: generate(
                    cluster, prompt_token_ids=p, max_tokens=max_tokens, ignore_eos=True
                ),
                PROMPTS,
            )
        )
    expected = oracle_greedy_many(cluster.model_dir, PROMPTS, max_tokens)
    for stream, tokens in zip(streams, expected, strict=True):
        assert [t for r in stream for t in r.token_ids] == tokens
        assert stream[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_a_stop_string_and_a_stop_token_end_the_stream_where_they_are(
    cluster: RunningCluster,
) -> None:
    """The token computed past either end is dropped, and the cache is free after."""
    free = generate(cluster, prompt="Chunked prefills", max_tokens=24, ignore_eos=True)
    text = "".join(r.text for r in free)
    tokens = [t for r in free for t in r.token_ids]
    stop = text[5:7]
    assert stop
    stopped = generate(
        cluster, prompt="Chunked prefills", max_tokens=24, ignore_eos=True, stop=[stop]
    )
    assert "".join(r.text for r in stopped) == text[: text.index(stop)]
    by_token = generate(
        cluster,
        prompt="Chunked prefills",
        max_tokens=24,
        ignore_eos=True,
        stop_token_ids=[tokens[6]],
    )
    assert [t for r in by_token for t in r.token_ids] == tokens[: tokens.index(tokens[6]) + 1]
    assert by_token[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
    sched = cluster.stub.Status(generate_pb2.StatusRequest(), timeout=5).scheduler
    assert sched.num_running == 0
