"""A request whose step fails on the workers every time, on a live local cluster: it ends with an
error (gRPC INTERNAL; HTTP 500, or an error chunk when streamed) after its trial alone, a request
served beside it gets every token it gets alone, and the cluster serves on. Before the quarantine
such a request was requeued after each rebuild and failed it again, for ever.

The workers are `python -m stage_worker` with one fault: poison_worker.py raises in any step whose
plan holds the token POISON (in the poisoned prompts only)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from sarathi_proto import generate_pb2, generate_pb2_grpc
from sarathictl.local_cluster import LocalClusterConfig

from tests.integration.cluster_factories import (
    PatchedCluster,
    make_tiny_served_model,
    oracle_greedy,
    supervised,
)

pytestmark = pytest.mark.integration

POISON = 299
INNOCENT = [5, 17, 33, 80, 101, 7, 9]
POISONED = [3, 8, POISON, 4, 11]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PatchedCluster]:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-poison")
    config = LocalClusterConfig(
        model_dir=str(model_dir), pp=1, budget_tokens=64, port=0, http_port=0,
        kv_cache_bytes=16 << 20, log_dir=str(tmp_path_factory.mktemp("logs")),
    )  # fmt: skip
    # Its workers fail every step that holds the token POISON.
    poisoned = PatchedCluster(
        config, patched="stage", module="tests.integration.poison_worker",
        extra_env={"SARATHI_TEST_POISON_TOKEN": str(POISON)},
    )  # fmt: skip
    with supervised(poisoned) as running:
        yield running


@pytest.fixture(scope="module")
def expected(cluster: PatchedCluster) -> list[int]:
    tokens = oracle_greedy(Path(cluster.config.model_dir), INNOCENT, 40)
    assert POISON not in tokens  # else the innocent request would be poisoned too
    return tokens


def innocent_request() -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(prompt_token_ids=INNOCENT, max_tokens=40, ignore_eos=True)


def test_a_poisoned_request_ends_internal_and_the_one_beside_it_is_served_whole(
    cluster: PatchedCluster, expected: list[int]
) -> None:
    got: list[int] = []
    streaming = threading.Event()

    def serve_innocent(stub: generate_pb2_grpc.GenerationStub) -> None:
        for response in stub.Generate(innocent_request(), timeout=240):
            got.extend(response.token_ids)
            streaming.set()

    with grpc.insecure_channel(cluster.addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        innocent = threading.Thread(target=serve_innocent, args=(stub,))
        innocent.start()
        assert streaming.wait(120)
        # While the innocent request decodes: its decodes and the poisoned prompt share a step.
        poisoned = generate_pb2.GenerateRequest(prompt_token_ids=POISONED, max_tokens=8)
        with pytest.raises(grpc.RpcError) as failed:
            list(stub.Generate(poisoned, timeout=240))
        innocent.join(240)
        scheduler = stub.Status(generate_pb2.StatusRequest(), timeout=10).scheduler
    assert scheduler.num_quarantined == 1 and scheduler.num_suspects == 0
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    details = failed.value.details() or ""
    assert "quarantined" in details and f"token {POISON} is poison" in details, details
    assert got == expected
    log_text = (cluster.log_dir / "controller.log").read_text(errors="replace")
    assert "ends with an error" in log_text and "failed micro-batch" in log_text, log_text


def test_over_http_it_is_a_500_whole_and_an_error_chunk_streamed_and_serving_goes_on(
    cluster: PatchedCluster, expected: list[int]
) -> None:
    url = f"http://127.0.0.1:{cluster.http_port}/v1/completions"
    body = {"model": Path(cluster.config.model_dir).name, "prompt": POISONED, "max_tokens": 8}
    answer = httpx.post(url, json=body, timeout=240)
    assert answer.status_code == 500, answer.text
    error = answer.json()["error"]
    assert error["code"] == "request_failed" and f"token {POISON} is poison" in error["message"]

    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=240) as streamed:
        assert streamed.status_code == 200
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["error"]["code"] == "request_failed", lines

    start = time.monotonic()
    with grpc.insecure_channel(cluster.addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        responses = list(stub.Generate(innocent_request(), timeout=240))
    assert [t for r in responses for t in r.token_ids] == expected
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert time.monotonic() - start < 120
