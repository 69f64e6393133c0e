"""A model of the Gateway API Inference Extension's endpoint picker (EPP), the one the chart
deploys (deploy/helm/sarathi-cluster/files/epp-config.yaml), so that `bench prefix-routing` can
measure its prefix hit rate against real controllers without a Kubernetes cluster.

What it reproduces, from the EPP's documented behaviour:
- prefix-cache-scorer, "estimation mode": the request's prompt text cut into blocks of
  BLOCK_CHARS characters (16 tokens at its estimate of 4 characters a token), each block's
  hash chained to the one before and the first to the model's name; an index remembers, per
  endpoint, the hashes of the requests it routed there (LRU, a capacity per endpoint), not
  what the endpoint really caches. An endpoint's score is the run of leading blocks it holds
  over the prompt's blocks.
- queue-scorer: (most waiting - its waiting) / (most - fewest) over the candidates; all 1 when
  they wait alike.
- kv-cache-utilization-scorer: 1 - its KV-cache usage.
- The pick: the highest weighted sum; ties broken at random.

Pure: no clock, no network. The caller scrapes the endpoints' metrics and records the pick.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

BLOCK_CHARS = 64
"""Characters per hashed block: the EPP's 16-token block at 4 characters a token."""
MAX_BLOCKS = 256
"""Leading blocks it hashes at most (the EPP's default)."""
LRU_BLOCKS_PER_ENDPOINT = 31_250
"""Hashes the index keeps per endpoint (the EPP's default)."""


@dataclass(frozen=True)
class Weights:
    """The scorers' weights in a scheduling profile."""

    queue: float
    kv_cache: float
    prefix: float

    def __post_init__(self) -> None:
        for name in ("queue", "kv_cache", "prefix"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} weight must be >= 0, got {getattr(self, name)}")


CHART_WEIGHTS = Weights(queue=2, kv_cache=2, prefix=1)
"""The chart's default profile (files/epp-config.yaml)."""


@dataclass(frozen=True)
class EndpointLoad:
    """What the EPP scrapes from an endpoint's /metrics."""

    waiting: int
    """sarathi:num_requests_waiting"""
    kv_cache_usage: float
    """sarathi:kv_cache_usage_perc, 0..1"""


def prompt_block_hashes(model: str, prompt: str, max_blocks: int = MAX_BLOCKS) -> list[bytes]:
    """The prompt's full blocks of BLOCK_CHARS characters, each hash chained to the previous
    one (the first to the model), at most max_blocks; a trailing partial block is not hashed."""
    previous = hashlib.blake2b(model.encode(), digest_size=8).digest()
    hashes = []
    data = prompt.encode()
    for start in range(0, min(len(data) // BLOCK_CHARS, max_blocks) * BLOCK_CHARS, BLOCK_CHARS):
        previous = hashlib.blake2b(
            previous + data[start : start + BLOCK_CHARS], digest_size=8
        ).digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Per endpoint, the block hashes of the prompts routed to it, least recently used first."""

    def __init__(self, capacity_per_endpoint: int = LRU_BLOCKS_PER_ENDPOINT) -> None:
        if capacity_per_endpoint < 1:
            raise ValueError(f"capacity_per_endpoint must be >= 1, got {capacity_per_endpoint}")
        self.capacity = capacity_per_endpoint
        self._lru: dict[str, OrderedDict[bytes, None]] = {}

    def add(self, hashes: Sequence[bytes], endpoint: str) -> None:
        lru = self._lru.setdefault(endpoint, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def matched_blocks(self, hashes: Sequence[bytes], endpoint: str) -> int:
        """Leading blocks of `hashes` the endpoint was sent."""
        lru = self._lru.get(endpoint)
        if lru is None:
            return 0
        for count, h in enumerate(hashes):
            if h not in lru:
                return count
        return len(hashes)


def queue_scores(loads: Mapping[str, EndpointLoad]) -> dict[str, float]:
    waiting = [load.waiting for load in loads.values()]
    most, fewest = max(waiting), min(waiting)
    if most == fewest:
        return dict.fromkeys(loads, 1.0)
    return {e: (most - load.waiting) / (most - fewest) for e, load in loads.items()}


def scores(
    hashes: Sequence[bytes],
    loads: Mapping[str, EndpointLoad],
    index: PrefixIndex,
    weights: Weights,
) -> dict[str, float]:
    """Each endpoint's weighted score for a prompt with these block hashes."""
    queue = queue_scores(loads)
    total = {}
    for endpoint, load in loads.items():
        prefix = index.matched_blocks(hashes, endpoint) / len(hashes) if hashes else 0.0
        total[endpoint] = (
            weights.queue * queue[endpoint]
            + weights.kv_cache * (1.0 - load.kv_cache_usage)
            + weights.prefix * prefix
        )
    return total


def pick(
    hashes: Sequence[bytes],
    loads: Mapping[str, EndpointLoad],
    index: PrefixIndex,
    weights: Weights,
    rng: random.Random,
) -> str:
    """The endpoint the EPP sends the request to; records its hashes there, as the EPP does
    once it has routed a request."""
    if not loads:
        raise ValueError("no endpoints to pick from")
    by_endpoint = scores(hashes, loads, index, weights)
    best = max(by_endpoint.values())
    chosen = rng.choice(sorted(e for e, s in by_endpoint.items() if s == best))
    index.add(hashes, chosen)
    return chosen
