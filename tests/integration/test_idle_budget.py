"""The idle budget on a live local cluster (PP=1, a tiny random model): `up`'s flag reaches the
controller, status reports it, and a prompt that arrives with nothing decoding goes in idle-budget
chunks, while one beside a decoding request keeps to the budget."""

from __future__ import annotations

import json
import threading

import pytest
from sarathi_proto import generate_pb2
from sarathictl.client import Client
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig

from tests.integration.cluster_factories import make_tiny_served_model

pytestmark = pytest.mark.integration


def request(seed: int, num_tokens: int, max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        prompt_token_ids=[5 + (seed + t) % 200 for t in range(num_tokens)],
        max_tokens=max_tokens,
        ignore_eos=True,
    )


def test_a_lone_prompt_takes_the_idle_budget_and_one_beside_a_decode_the_budget(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")
    step_log = tmp_path_factory.mktemp("steps") / "steps.jsonl"
    config = LocalClusterConfig(
        model_dir=str(model_dir), pp=1, budget_tokens=32, idle_budget_tokens=128, port=0,
        kv_cache_bytes=16 << 20, log_dir=str(tmp_path_factory.mktemp("logs")),
        extra_controller_args=("--step-log", str(step_log)),
    )  # fmt: skip
    with LocalCluster(config) as cluster, Client(cluster.addr) as client:
        scheduler = client.status().scheduler
        assert (scheduler.budget_tokens, scheduler.idle_budget_tokens) == (32, 128)
        alone = list(client.generate(request(0, 150, 2), timeout_s=120))
        assert sum(len(r.token_ids) for r in alone) == 2
        # A long decode, and a prompt sent once its first token is out: it meets a decode. The
        # decode runs to the model's last positions, seconds even on a fast CPU, so a test
        # thread slow to send the prompt still finds it decoding.
        first_token = threading.Event()

        def decode_long() -> None:
            for r in client.generate(request(1, 3, 1000), timeout_s=120):
                if r.token_ids:
                    first_token.set()

        decoder = threading.Thread(target=decode_long)
        decoder.start()
        assert first_token.wait(60)
        beside = list(client.generate(request(2, 100, 1), timeout_s=120))
        decoder.join(120)
        assert sum(len(r.token_ids) for r in beside) == 1
    lines = [json.loads(line) for line in step_log.read_text().splitlines()]
    prompt_steps = [
        (line["prompt_tokens"], line["decodes"]) for line in lines if line["prompt_tokens"]
    ]
    # 150 tokens alone: 128 and 22; the 3-token prompt alone; then 100 tokens beside a decode,
    # in chunks of the budget less that decode.
    assert prompt_steps[:3] == [(128, 0), (22, 0), (3, 0)]
    assert [tokens for tokens, _ in prompt_steps[3:]] == [31, 31, 31, 7]
    assert all(decodes == 1 for _, decodes in prompt_steps[3:])
