"""Real `python -m stage_worker` processes on the GPU, over ZeroMQ, driven by the real scheduler:
PP=1 and PP=2 as two workers sharing the one GPU, linked with
gloo through host memory (NCCL refuses two ranks on one device). Tokens equal transformers'."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.integration.stage_worker.pipeline_driver import LocalPipeline
from tests.unit.stage_worker.tiny_models import VOCAB_SIZE, load_oracle, oracle_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPT_LENGTHS = (37, 5, 70, 21)
MAX_TOKENS = 6


@pytest.mark.parametrize(
    ("pp", "arch", "extra"),
    [
        (1, "llama", ["--cuda-graphs"]),
        (1, "falcon_new", []),
        (2, "falcon_mq", ["--comm-backend", "gloo", "--cuda-graphs"]),
        (2, "llama", ["--comm-backend", "gloo"]),
    ],
)
def test_cuda_workers_generate_transformers_tokens(
    pp: int, arch: str, extra: list[str], tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = tiny_checkpoint(arch)
    prompts = [
        [(5 * i + 11 * j + 2) % VOCAB_SIZE for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)
    ]
    args = ["--device", "cuda", "--gpu-memory-fraction", "0.05", *extra]
    with LocalPipeline(model_dir, pp, 1, max_kv_blocks=256, extra_args=args) as pipeline:
        run = pipeline.generate(prompts, MAX_TOKENS)
        codes = pipeline.close()
    oracle = load_oracle(model_dir).to("cuda")
    for seq_id, prompt in enumerate(prompts):
        assert run.tokens[seq_id] == oracle_greedy(oracle, prompt, MAX_TOKENS), seq_id
    assert codes == [0] * pp
