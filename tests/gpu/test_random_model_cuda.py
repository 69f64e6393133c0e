"""`sarathictl model random-llama --device cuda`: the weights drawn by the GPU's generator
(tools/gpu_check.sh writes the live benchmark's Mistral-7B this way), saved as a CPU checkpoint
of the shape asked, N(0, 0.02) in the dtype asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sarathictl.bench.random_model import SHAPES, write_random_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_weights_drawn_on_the_gpu_make_the_same_checkpoint_layout(tmp_path: Path) -> None:
    on_gpu = load_file(
        write_random_llama(tmp_path / "gpu", "tiny", torch.bfloat16, device="cuda")
        / "model.safetensors"
    )
    on_cpu = load_file(
        write_random_llama(tmp_path / "cpu", "tiny", torch.bfloat16) / "model.safetensors"
    )
    assert {k: (v.shape, v.dtype) for k, v in on_gpu.items()} == {
        k: (v.shape, v.dtype) for k, v in on_cpu.items()
    }
    embed = on_gpu["model.embed_tokens.weight"]
    assert embed.shape == (SHAPES["tiny"]["vocab_size"], SHAPES["tiny"]["hidden_size"])
    assert abs(embed.float().std().item() - 0.02) < 0.002
    assert not torch.equal(embed, on_cpu["model.embed_tokens.weight"])  # the GPU's own draw
