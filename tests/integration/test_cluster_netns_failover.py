"""Controller failover in cluster mode (issue 16, item 3): two controllers of one pipeline on
namespace hosts of their own, elected through an etcd lease, the active one killed with SIGKILL
while `sarathictl generate` clients stream through both addresses. The standby must take over,
and every client's stream (greedy, seeded sampled, sampled with the server's seed) must complete
through resume, equal to its undisturbed run. The takeover time is printed for RELIABILITY.md
(issue 16's target: serving within 5 s of the kill); as every timing target, it is measured
there, not asserted here.

The processes are supervised as Kubernetes would (an exited one starts again with the same argv):
the killed controller, held down until the standby took over (its node is gone), comes back as
the new standby. The workers leave the pipeline as soon as the active controller's key goes from
etcd and join the new controller in their own processes, keeping their weights.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.integration.netns_cluster import (
    NETNS_TEST_MARKS,
    NamespacedCluster,
    namespaced_cluster,
    wait_until,
)

pytestmark = NETNS_TEST_MARKS

LEADER_LEASE_S = 2
MAX_TOKENS = 800  # long enough that all three stream at the kill
# (prompt, sampling flags): greedy, seeded sampled, and sampled with a seed the server draws.
CLIENTS = [
    ("The pipeline", ()),
    ("Chunked prefills", ("--temperature", "0.8", "--top-p", "0.9", "--seed", "1234")),
    ("Stages and bubbles", ("--temperature", "0.8", "--top-p", "0.9")),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NamespacedCluster]:
    with namespaced_cluster(
        tmp_path_factory,
        controller_flags=("--leader-lease", str(LEADER_LEASE_S), "--heartbeat-timeout", "3"),
        worker_flags=("--controller-timeout", "5"),
        standby=True,
    ) as running:
        running.supervise()
        yield running


def generate_argv(cluster: NamespacedCluster, prompt: str, flags: tuple[str, ...]) -> list[str]:
    return cluster.sarathictl_argv(
        "generate", prompt, "--addr", cluster.controller_addrs, "--max-tokens", str(MAX_TOKENS),
        "--ignore-eos", "--json", "--retries", "30", *flags,
    )  # fmt: skip


def start_clients(cluster: NamespacedCluster) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(generate_argv(cluster, p, f), stdout=-1, stderr=-1, text=True)
        for p, f in CLIENTS
    ]


def finished(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    answer: dict[str, object] = json.loads(out)
    answer["stderr"] = err
    return answer


def test_the_standby_takes_over_and_every_stream_completes_through_resume(
    cluster: NamespacedCluster,
) -> None:
    assert cluster.healthy("ctl") and cluster.is_standby("ctl2")
    # Kubernetes restarts a pod whose startup or liveness probe fails: a standby must pass both
    # (the empty name) while its readiness (the API's name) keeps the Services off it.
    assert cluster.alive("ctl2") and not cluster.healthy("ctl2")
    undisturbed = [finished(c) for c in start_clients(cluster)]
    clients = start_clients(cluster)
    cluster.wait_for(
        lambda: cluster.status("ctl").scheduler.num_running == len(CLIENTS), 60, "all streaming"
    )
    time.sleep(0.5)  # tokens are streaming
    # Its node is gone: the killed controller is not back before the standby took over (else the
    # two would race for the key when the lease ends, and either may win).
    with cluster.hold("controller"):
        cluster.kill("controller")
        takeover_s = cluster.wait_for(lambda: cluster.healthy("ctl2"), 60, "the standby serving")
    disturbed = [finished(c) for c in clients]
    print(
        f"\nnamespace cluster, kill -9 of the active controller: the standby served "
        f"{takeover_s:.2f} s after the kill (leader lease {LEADER_LEASE_S} s); "
        f"{len(CLIENTS)} streams resumed, 0 lost"
    )
    for before, after, (prompt, flags) in zip(undisturbed, disturbed, CLIENTS, strict=True):
        assert "resuming after" in str(after["stderr"]), (prompt, after["stderr"])
        assert after["finish_reason"] == "length"
        if "--temperature" in flags and "--seed" not in flags:
            # The server drew its seed; the resume kept it: replayed with it, the stream is the
            # same, and it is not the first run's (another seed).
            replay_flags = (*flags, "--seed", str(after["seed"]))
            argv = generate_argv(cluster, prompt, replay_flags)
            before = finished(subprocess.Popen(argv, stdout=-1, stderr=-1, text=True))
            assert after["seed"] != undisturbed[CLIENTS.index((prompt, flags))]["seed"]
        assert after["token_ids"] == before["token_ids"], prompt
        assert after["text"] == before["text"], prompt
    # The workers joined the new controller in their own processes (weights kept), not after a
    # restart; the killed controller came back as the standby.
    restarted = {w: cluster.restarts.get(w, 0) for w in ("s0", "s1")}
    assert restarted == {"s0": 0, "s1": 0}, cluster.log_tails()
    wait_until(lambda: cluster.is_standby("ctl"), 60, "the old controller back as a standby")
    status = cluster.status("ctl2")
    assert status.serving and [s.host for s in status.stages] == [
        cluster.net.addresses["s0"],
        cluster.net.addresses["s1"],
    ]
