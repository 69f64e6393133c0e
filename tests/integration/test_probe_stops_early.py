"""A live capacity probe past capacity stops once its miss is certain: the requests left are
cancelled, the controller lets them go, and the next probe starts on an empty cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from sarathictl.bench.live_load import replay
from sarathictl.bench.probe_verdict import ProbeBounds
from sarathictl.client import Client
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig

from controller.executor.simulated import SimRequest
from tests.integration.cluster_factories import make_tiny_served_model

pytestmark = pytest.mark.integration

NUM_REQUESTS = 24
OUTPUT_TOKENS = 200


def burst() -> list[SimRequest]:
    """Every request at once, each decoding 200 tokens."""
    return [SimRequest(0.01 * i, 8, OUTPUT_TOKENS) for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")
    config = LocalClusterConfig(
        model_dir=str(model_dir), pp=1, budget_tokens=32, max_num_seqs=4, port=0,
        kv_cache_bytes=16 << 20, prefix_caching=False,
        log_dir=str(tmp_path_factory.mktemp("logs")),
    )  # fmt: skip
    with LocalCluster(config) as served:
        yield served


def assert_stopped_and_drained(cluster: LocalCluster, run_reason: str, expected: str) -> None:
    assert run_reason == expected
    with Client(cluster.addr) as client:
        scheduler = client.status().scheduler
    assert (scheduler.num_waiting, scheduler.num_running) == (0, 0)


def test_a_tbt_miss_stops_the_probe(cluster: LocalCluster) -> None:
    # No gap can be within 1 µs: 2 late gaps in ~24 x 199 settle the P99.
    run = asyncio.run(replay(cluster.addr, burst(), bounds=ProbeBounds(1e-6, poll_s=0.05)))
    assert_stopped_and_drained(cluster, run.stop_reason, "P99 TBT over 1e-06 s for sure")
    cancelled = [r for r in run.records if r.error.startswith("CANCELLED")]
    assert cancelled, "every request ran to its end: the probe did not stop"
    assert all(r.tokens_seen < OUTPUT_TOKENS for r in cancelled)
    metrics = run.metrics()
    assert metrics.stopped_early and not metrics.meets(tbt_slo_s=1e-6)


def test_a_queue_past_the_delay_bound_stops_the_probe(cluster: LocalCluster) -> None:
    # Four run at once (max_num_seqs) and 20 wait; with a delay bound of 0 s every one of them
    # is late as soon as it waits, more than half of the probe.
    bounds = ProbeBounds(tbt_slo_s=60.0, max_median_delay_s=0.0, poll_s=0.05)
    run = asyncio.run(replay(cluster.addr, burst(), bounds=bounds))
    assert_stopped_and_drained(cluster, run.stop_reason, "median delay over 0 s for sure")
    assert sum(1 for r in run.records if r.error.startswith("CANCELLED")) >= NUM_REQUESTS // 2


def test_a_probe_within_its_bounds_runs_to_its_end(cluster: LocalCluster) -> None:
    requests = burst()[:4]
    run = asyncio.run(replay(cluster.addr, requests, bounds=ProbeBounds(60.0, poll_s=0.05)))
    assert run.stop_reason == ""
    assert [r.tokens_seen for r in run.records] == [OUTPUT_TOKENS] * 4
    assert run.metrics().meets(tbt_slo_s=60.0)
