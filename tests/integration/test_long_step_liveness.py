"""A step longer than the controller's heartbeat timeout is not a dead worker: while it steps,
the worker says it lives from a thread (`alive`), so a whole prompt that takes seconds on a CPU
thread completes instead of taking the pipeline down mid-step. With two stages, the second waits
for the first's long step past its peer wait (the workers' --controller-timeout): the
controller's pings say the first is still stepping, so the wait goes on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from sarathi_proto import generate_pb2
from sarathictl.bench.random_model import write_random_llama
from sarathictl.client import Client
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig

pytestmark = pytest.mark.integration

HEARTBEAT_TIMEOUT_S = 1.0
PEER_WAIT_S = 1.0  # the workers' --controller-timeout (its least)
PROMPT_TOKENS = 1500  # one step of the vllm policy: seconds on one CPU thread


@pytest.mark.parametrize("pp", [1, 2])
def test_a_whole_prompt_step_past_the_heartbeat_timeout_completes(tmp_path: Path, pp: int) -> None:
    model_dir = write_random_llama(tmp_path / "smollm2", "smollm2-135m", torch.bfloat16)
    config = LocalClusterConfig(
        model_dir=str(model_dir), pp=pp, policy="vllm", budget_tokens=2048, port=0,
        threads_per_worker=1, prefix_caching=False, log_dir=str(tmp_path / "logs"),
        extra_controller_args=("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)),
        extra_worker_args=("--controller-timeout", str(PEER_WAIT_S)),
    )  # fmt: skip
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=[5 + i % 200 for i in range(PROMPT_TOKENS)], max_tokens=2, ignore_eos=True
    )
    with LocalCluster(config) as cluster, Client(cluster.addr) as client:
        started = time.monotonic()
        responses = list(client.generate(request, timeout_s=120))
        ttft_s = responses[-1].ttft_s
        assert sum(len(r.token_ids) for r in responses) == 2
        assert client.status().serving
    # Each stage's step is over the limits (a pipeline's first token: its two steps in turn).
    assert ttft_s > pp * 2 * max(HEARTBEAT_TIMEOUT_S, PEER_WAIT_S), f"{ttft_s:.2f} s proves nothing"
    log = (tmp_path / "logs" / "controller.log").read_text()
    assert "pipeline down" not in log, f"{time.monotonic() - started:.1f} s; {log[-2000:]}"
