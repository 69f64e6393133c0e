"""Prefix caching against real stage workers: a prompt that starts past its cached prefix (its
first chunk past position 0, reading KV another sequence wrote, or a copy of it) gets the tokens
transformers computes from the whole prompt, at PP 1 and 2 and with TP 2; sampled streams draw
the same with and without hits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from controller.scheduler import RequestParams, SamplingParams
from tests.integration.stage_worker.pipeline_driver import LocalPipeline
from tests.unit.stage_worker.tiny_models import VOCAB_SIZE, load_oracle, oracle_greedy

pytestmark = pytest.mark.integration

BLOCK = 16
MAX_TOKENS = 5
BASE = [(7 * j + 3) % VOCAB_SIZE for j in range(4 * BLOCK)]  # 4 full blocks


def suffix(i: int, n: int = 5) -> list[int]:
    return [(13 * i + 5 * j + 1) % VOCAB_SIZE for j in range(n)]


# Prompts sharing BASE's first tokens: around a block edge, then whole prompts cached (a block
# edge at the end: the last block is copied and its last token computed), and BASE itself.
SHARING = [
    BASE[: BLOCK - 1] + suffix(1),
    BASE[:BLOCK] + suffix(2),
    BASE[: BLOCK + 1] + suffix(3),
    BASE[: 3 * BLOCK],
    BASE[: 3 * BLOCK + 2],
    BASE,
]


@pytest.mark.parametrize(
    ("pp", "tp", "arch"), [(1, 1, "llama"), (2, 1, "falcon_new"), (2, 2, "llama")]
)
def test_greedy_tokens_with_cached_prefixes_equal_transformers(
    pp: int, tp: int, arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = tiny_checkpoint(arch)
    with LocalPipeline(model_dir, pp, tp, block_size=BLOCK) as pipeline:
        cached = pipeline.make_scheduler()
        first = pipeline.generate([BASE], MAX_TOKENS, scheduler=cached)
        second = pipeline.generate(SHARING, MAX_TOKENS, scheduler=cached, first_seq_id=1)
        stats = cached.prefix_cache.stats
        plain = pipeline.make_scheduler(prefix_caching=False)
        uncached = pipeline.generate(SHARING, MAX_TOKENS, scheduler=plain, first_seq_id=100)
    # Every sharing prompt but the first (15 tokens: no full block) started past its prefix.
    assert stats.num_hit_requests == len(SHARING) - 1
    assert stats.num_cached_tokens == BLOCK + BLOCK + 47 + 48 + 63
    oracle = load_oracle(model_dir)
    assert first.tokens[0] == oracle_greedy(oracle, BASE, MAX_TOKENS)
    for i, prompt in enumerate(SHARING):
        expected = oracle_greedy(oracle, prompt, MAX_TOKENS)
        assert second.tokens[1 + i] == expected, (i, len(prompt))
        assert uncached.tokens[100 + i] == expected, (i, len(prompt))


def test_sampled_streams_draw_the_same_with_and_without_hits(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    model_dir = tiny_checkpoint("llama")
    params = [
        RequestParams(max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=seed))
        for seed in range(len(SHARING))
    ]
    with LocalPipeline(model_dir, 2, 1, block_size=BLOCK) as pipeline:
        plain = pipeline.make_scheduler(prefix_caching=False)
        uncached = pipeline.generate(SHARING, 0, params=params, scheduler=plain)
        cached = pipeline.make_scheduler()
        pipeline.generate([BASE], MAX_TOKENS, scheduler=cached, first_seq_id=100)
        hits = pipeline.generate(SHARING, 0, params=params, scheduler=cached, first_seq_id=101)
    assert cached.prefix_cache.stats.num_hit_requests == len(SHARING) - 1
    for i in range(len(SHARING)):
        assert hits.tokens[101 + i] == uncached.tokens[i], i
