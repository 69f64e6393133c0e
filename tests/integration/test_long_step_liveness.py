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
LIMIT_S = max(HEARTBEAT_TIMEOUT_S, PEER_WAIT_S)
# A whole prompt of the vllm policy is one step. Its length is sized on the machine at hand, so
# that each stage's step outlasts both limits about 4 times (CPUs here differ 3x and more in
# speed); at least 1,500 tokens, and within the model's 8,192 positions.
CALIBRATION_TOKENS = 256
MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS = 1500, 7000


def _prompt(num_tokens: int, max_tokens: int) -> generate_pb2.GenerateRequest:
    ids = [5 + i % 200 for i in range(num_tokens)]
    return generate_pb2.GenerateRequest(
        prompt_token_ids=ids, max_tokens=max_tokens, ignore_eos=True
    )


def _long_prompt_tokens(client: Client, pp: int) -> int:
    """Tokens whose whole-prompt step takes each of pp stages about 4 * LIMIT_S here (the
    faster of two short prompts: the first pays for first use)."""
    ttft_s = min(
        list(client.generate(_prompt(CALIBRATION_TOKENS, 1), timeout_s=120))[-1].ttft_s
        for _ in range(2)
    )
    tokens = CALIBRATION_TOKENS * 4 * LIMIT_S * pp / ttft_s
    return int(min(MAX_PROMPT_TOKENS, max(MIN_PROMPT_TOKENS, tokens)))


@pytest.mark.parametrize("pp", [1, 2])
def test_a_whole_prompt_step_past_the_heartbeat_timeout_completes(tmp_path: Path, pp: int) -> None:
    model_dir = write_random_llama(tmp_path / "smollm2", "smollm2-135m", torch.bfloat16)
    config = LocalClusterConfig(
        model_dir=str(model_dir), pp=pp, policy="vllm", budget_tokens=8192, port=0,
        threads_per_worker=1, prefix_caching=False, log_dir=str(tmp_path / "logs"),
        # MAX_PROMPT_TOKENS of float32 KV on one stage; zeroing it outlasts the heartbeat
        # timeout too (before the keepalive covered it, the pipeline went down there).
        kv_cache_bytes=512 << 20,
        extra_controller_args=("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)),
        extra_worker_args=("--controller-timeout", str(PEER_WAIT_S)),
    )  # fmt: skip
    with LocalCluster(config) as cluster, Client(cluster.addr) as client:
        num_tokens = _long_prompt_tokens(client, pp)
        started = time.monotonic()
        responses = list(client.generate(_prompt(num_tokens, 2), timeout_s=300))
        ttft_s = responses[-1].ttft_s
        assert sum(len(r.token_ids) for r in responses) == 2
        assert client.status().serving
    # Each stage's step is over the limits (a pipeline's first token: its steps in turn). Sized
    # for 4x the limits a stage, so a machine that sped up since the calibration still passes.
    assert ttft_s > pp * 1.5 * LIMIT_S, f"{num_tokens} tokens in {ttft_s:.2f} s prove nothing"
    log = (tmp_path / "logs" / "controller.log").read_text()
    assert "pipeline down" not in log, f"{time.monotonic() - started:.1f} s; {log[-2000:]}"
