"""A plan the stage workers reject (PlanError) on a live local cluster (PP=2): the controller
logs it, rebuilds the pipeline and finishes the request as if nothing had happened, instead of
a receive loop that died on the refusal and a controller that no longer hears its workers.

The controller is `python -m controller` with one fault: rejected_plan_controller.py sends one
plan naming a sequence no worker knows, as a controller whose state had drifted from its
workers' would."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
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

REJECTED_BATCH_ID = 6  # the fifth decode of the first request: it is mid-stream


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PatchedCluster]:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-rejected")
    config = LocalClusterConfig(
        model_dir=str(model_dir), pp=2, budget_tokens=64, port=0, kv_cache_bytes=16 << 20,
        log_dir=str(tmp_path_factory.mktemp("logs")),
    )  # fmt: skip
    # Its controller sends one plan the workers reject.
    rejecting = PatchedCluster(
        config, patched="controller", module="tests.integration.rejected_plan_controller",
        extra_env={"SARATHI_TEST_REJECTED_BATCH_ID": str(REJECTED_BATCH_ID)},
    )  # fmt: skip
    with supervised(rejecting) as running:
        yield running


def stream_tokens(stub: generate_pb2_grpc.GenerationStub, prompt: list[int]) -> list[int]:
    request = generate_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True)
    responses = list(stub.Generate(request, timeout=120))
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    return [t for r in responses for t in r.token_ids]


def test_a_rejected_plan_is_logged_the_pipeline_rebuilt_and_the_stream_completes(
    cluster: PatchedCluster,
) -> None:
    prompt = [5, 17, 33, 80, 101, 7, 9]
    expected = oracle_greedy(Path(cluster.config.model_dir), prompt, 24)
    with grpc.insecure_channel(cluster.addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        assert stream_tokens(stub, prompt) == expected  # through the rejection, unbroken
        log_text = (cluster.log_dir / "controller.log").read_text(errors="replace")
        assert f"rejected the plan of micro-batch {REJECTED_BATCH_ID}" in log_text, log_text
        assert "pipeline rebuilt (#1)" in log_text, log_text
        # The health watch re-evaluates every 0.25 s: a 24-token stream on the rebuilt pipeline
        # can end before it has published the rebuild.
        deadline = time.monotonic() + 10
        status = stub.Status(generate_pb2.StatusRequest(), timeout=5)
        while not status.serving and time.monotonic() < deadline:
            time.sleep(0.1)
            status = stub.Status(generate_pb2.StatusRequest(), timeout=5)
        assert status.serving, status.problem
        start = time.monotonic()
        assert stream_tokens(stub, prompt) == expected  # the rebuilt pipeline serves
        assert time.monotonic() - start < 60
