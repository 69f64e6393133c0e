"""Cluster mode over real links: etcd, the controller and each pipeline stage on hosts of their
own (network namespaces joined through a bridge), as `helm install` lays them out on nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from controller.tokenizer import Tokenizer
from tests.integration.cluster_factories import oracle_greedy
from tests.integration.netns_cluster import (
    ETCD_PORT,
    NETNS_TEST_MARKS,
    NamespacedCluster,
    namespaced_cluster,
)

pytestmark = NETNS_TEST_MARKS


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NamespacedCluster]:
    with namespaced_cluster(tmp_path_factory) as running:
        yield running


def test_generation_over_the_namespaced_cluster_matches_the_oracle(
    cluster: NamespacedCluster,
) -> None:
    prompt = "The capital of France"
    run = cluster.sarathictl(
        "generate", prompt, "--addr", cluster.addr, "--max-tokens", "10", "--ignore-eos", "--json"
    )
    assert run.returncode == 0, run.stderr + cluster.log_tails()
    tokens = json.loads(run.stdout)["token_ids"]
    prompt_ids = Tokenizer.from_dir(cluster.model_dir).encode(prompt)
    assert tokens == oracle_greedy(cluster.model_dir, prompt_ids, 10)


def test_status_shows_each_stage_on_its_own_host(cluster: NamespacedCluster) -> None:
    run = cluster.sarathictl("status", "--addr", cluster.addr, "--json")
    assert run.returncode == 0, run.stderr
    stages = json.loads(run.stdout)["stages"]
    hosts = [s["host"] for s in stages]
    assert hosts == [cluster.net.addresses["s0"], cluster.net.addresses["s1"]]
    table = cluster.sarathictl("status", "--addr", cluster.addr).stdout
    assert cluster.net.addresses["s1"] in table


def test_a_second_worker_for_a_taken_place_is_refused(cluster: NamespacedCluster) -> None:
    late = subprocess.run(
        cluster.net.command("s1", [
            sys.executable, "-m", "stage_worker", "--model", str(cluster.model_dir),
            "--etcd", f"{cluster.net.addresses['ctl']}:{ETCD_PORT}", "--cluster", "t",
            "--stage", "1", "--tp-rank", "0", "--dtype", "float32",
        ]),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert late.returncode != 0
    assert "stage 1 rank 0" in late.stdout + late.stderr
