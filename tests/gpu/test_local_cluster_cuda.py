"""`sarathictl up --local --pp 2 --device cuda` end to end on one GPU: the controller, and two
workers that share the GPU (local_devices.py places both on cuda:0, linked with gloo through
host memory). Greedy tokens through gRPC equal transformers' for requests in flight together."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
import torch
from sarathi_proto import generate_pb2
from sarathictl.client import Client
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig

from tests.integration.cluster_factories import make_tiny_served_model, oracle_greedy_many

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[5, 17, 33, 80, 101, 7, 9], list(range(40, 140)), [250, 3, 3, 3]]
MAX_TOKENS = 8


def test_two_stages_on_one_gpu_serve_transformers_tokens(tmp_path: Path) -> None:
    model_dir = make_tiny_served_model(tmp_path / "tiny")
    config = LocalClusterConfig(
        model_dir=str(model_dir), pp=2, device="cuda", dtype="float32", port=0,
        budget_tokens=64, log_dir=str(tmp_path / "logs"),
        extra_worker_args=("--gpu-memory-fraction", "0.05"),  # a tiny model: a small KV cache
    )  # fmt: skip

    def generate(client: Client, prompt: list[int]) -> list[int]:
        request = generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True
        )
        return [t for r in client.generate(request, timeout_s=120) for t in r.token_ids]

    with LocalCluster(config) as cluster, Client(cluster.addr) as client:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = list(pool.map(lambda p: generate(client, p), PROMPTS))
        worker_log = (cluster.log_dir / "stage1-rank0.log").read_text(errors="replace")
    assert streams == oracle_greedy_many(model_dir, PROMPTS, MAX_TOKENS)
    assert "on cuda:0 in" in worker_log and "joining gloo world of 2" in worker_log
