"""A worker killed while the pipeline is being rebuilt, after it said hello and took its place:
its restarted successor gets the place (the rebuild starts over if the places were already
assigned) and the cluster serves again. Before, the dead worker's place stayed taken: the
successor was refused ("already served") and restarted until `up`'s restart budget ran out.

The workers load for SARATHI_TEST_LOAD_S seconds more than the tiny model needs
(slow_load_worker.py), as a real model's would, so the kill lands mid-rebuild."""

from __future__ import annotations

import signal
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

LOAD_S = 4.0
PLACE = "-> stage 1 rank 0"  # the controller's log line when a worker takes stage 1's place


class SlowLoadCluster(PatchedCluster):
    def kill(self, name: str) -> None:
        dict(self.procs)[name].send_signal(signal.SIGKILL)

    def controller_log(self) -> str:
        return (self.log_dir / "controller.log").read_text(errors="replace")


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlowLoadCluster]:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-slow")
    config = LocalClusterConfig(
        model_dir=str(model_dir), pp=2, budget_tokens=64, port=0, kv_cache_bytes=16 << 20,
        log_dir=str(tmp_path_factory.mktemp("logs")),
    )  # fmt: skip
    slow = SlowLoadCluster(
        config, patched="stage", module="tests.integration.slow_load_worker",
        extra_env={"SARATHI_TEST_LOAD_S": str(LOAD_S)},
    )  # fmt: skip
    with supervised(slow) as running:
        yield running


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_worker_killed_mid_rebuild_gives_its_place_to_its_successor(
    cluster: SlowLoadCluster,
) -> None:
    prompt = [5, 17, 33, 80, 101, 7, 9]
    expected = oracle_greedy(Path(cluster.config.model_dir), prompt, 12)
    taken = cluster.controller_log().count(PLACE)
    cluster.kill("stage1-rank0")  # the pipeline goes down; both workers are restarted
    wait_for(lambda: cluster.controller_log().count(PLACE) > taken, 120, "no new stage 1 worker")
    cluster.kill("stage1-rank0")  # it said hello: it holds the place, loading (LOAD_S)
    # Found by its successor's hello (the place it asks for), or when the places are full.
    wait_for(lambda: " is gone" in cluster.controller_log(), 120, "the place stayed taken")

    request = generate_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True)
    deadline = time.monotonic() + 180
    with grpc.insecure_channel(cluster.addr) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        while True:  # held while down (--while-down hold): served once the rebuild is done
            try:
                responses = list(stub.Generate(request, timeout=120))
                break
            except grpc.RpcError as err:
                assert time.monotonic() < deadline, err
                time.sleep(0.5)
    assert [t for r in responses for t in r.token_ids] == expected
    assert "already served" not in cluster.controller_log()
