"""Greedy tokens of tiny Llama and Falcon models on CUDA equal transformers' on the same device,
eagerly and with decode steps replayed from CUDA graphs, for PP 1 and 2 (in one process)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.unit.stage_worker.inprocess import generate, make_runners
from tests.unit.stage_worker.tiny_models import ARCHS, VOCAB_SIZE, load_oracle, oracle_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPT_LENGTHS = (37, 5, 70, 21, 1, 130)  # ragged: decode batches of mixed context lengths
MAX_TOKENS = 8


def prompts() -> list[list[int]]:
    return [
        [(7 * i + 3 * j + 1) % VOCAB_SIZE for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)
    ]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_greedy_tokens_equal_transformers_on_cuda(
    arch: str, pp: int, cuda_graphs: bool, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = tiny_checkpoint(arch)
    runners = make_runners(model_dir, pp, num_blocks=64, device="cuda", cuda_graphs=cuda_graphs)
    out = generate(runners, prompts(), MAX_TOKENS)
    oracle = load_oracle(model_dir).to("cuda")
    for seq_id, prompt in enumerate(prompts()):
        assert out.tokens[seq_id] == oracle_greedy(oracle, prompt, MAX_TOKENS), seq_id
    if cuda_graphs:
        assert all(r.graphs is not None and r.graphs.num_captured > 0 for r in runners)


def test_graph_replays_equal_eager_steps_and_touch_no_other_block(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """Logits of every decode within float32 rounding of the eager run; the blocks no sequence
    owns are unchanged after the run (padding rows wrote the scratch block only)."""
    model_dir = tiny_checkpoint("llama")
    eager = generate(make_runners(model_dir, 1, num_blocks=64, device="cuda"), prompts(), 6)
    runners = make_runners(model_dir, 1, num_blocks=64, device="cuda", cuda_graphs=True)
    cache = runners[0].kv_cache
    unused = cache.data[:, :, 40 : cache.num_blocks].clone()  # the run needs < 40 blocks
    graphed = generate(runners, prompts(), 6)
    assert graphed.tokens == eager.tokens
    for seq_id, rows in eager.last_logits.items():
        for a, b in zip(rows, graphed.last_logits[seq_id], strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache.data[:, :, 40 : cache.num_blocks], unused)
