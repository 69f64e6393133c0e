"""`sarathictl model random-llama` writes a folder a local cluster serves: the GPU live
benchmark's Mistral-7B is made this way (tools/gpu_check.sh); here a SmolLM2-135M shape, the
smallest whose vocabulary holds the byte-level tokenizer, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sarathi_proto import generate_pb2
from sarathictl.client import Client
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig

pytestmark = pytest.mark.integration


def test_a_random_llama_folder_is_served_from_text(tmp_path: Path) -> None:
    model_dir = tmp_path / "random-smollm2"
    written = subprocess.run(
        [sys.executable, "-m", "sarathictl.cli", "model", "random-llama", str(model_dir),
         "--shape", "smollm2-135m", "--dtype", "bfloat16"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    assert "random smollm2-135m" in written.stdout
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"]) == (30, 49152)
    cluster_config = LocalClusterConfig(
        model_dir=str(model_dir), pp=1, port=0, dtype="bfloat16", log_dir=str(tmp_path / "logs")
    )
    with LocalCluster(cluster_config) as cluster, Client(cluster.addr) as client:
        request = generate_pb2.GenerateRequest(prompt="Pipelines", max_tokens=4, ignore_eos=True)
        responses = list(client.generate(request, timeout_s=120))
    assert sum(len(r.token_ids) for r in responses) == 4
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert responses[-1].num_prompt_tokens > 1  # the byte-level tokenizer encoded the text
