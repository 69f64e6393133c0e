"""Automatic prefix caching seen from the scheduler: each sequence's full KV blocks named by a
hash chain, the cached prefix a new sequence starts from, and the counts status reports.

A block's name is a hash of its tokens chained to the previous block's name, starting from a
root that stands for whatever else changes the KV (the model): one name stands for the whole
prefix up to the block's end, so two sequences share a block only when everything before it is
the same too. 128-bit BLAKE2b: a collision (a wrong hit) is not a practical concern.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from controller.scheduler.block_manager import BlockManager
from controller.scheduler.sequence import Sequence

HASH_BYTES = 16


def root_hash(salt: str) -> bytes:
    """The chain's start: a name for what besides the tokens makes the KV (the model)."""
    return hashlib.blake2b(salt.encode(), digest_size=HASH_BYTES).digest()


def chain_hashes(
    parent: bytes, token_ids: list[int], block_size: int, first_block: int, num_blocks: int
) -> list[bytes]:
    """Names of blocks first_block..num_blocks-1 of token_ids (all full), the first chained to
    parent (the root, or block first_block-1's name)."""
    names = []
    blake2b = hashlib.blake2b
    # One conversion of every token to 8 bytes, then a slice of it per block.
    data = array("q", token_ids[first_block * block_size : num_blocks * block_size]).tobytes()
    step = 8 * block_size
    for start in range(0, len(data), step):
        parent = blake2b(parent + data[start : start + step], digest_size=HASH_BYTES).digest()
        names.append(parent)
    return names


@dataclass
class PrefixCacheStats:
    """Counted at each sequence's first admission (a request's n sequences count n times; a
    recompute after preemption does not count again)."""

    num_requests: int = 0
    """Sequences admitted with the cache on."""
    num_hit_requests: int = 0
    """Of them, those that started from at least one cached token."""
    num_prompt_tokens: int = 0
    """Their tokens at admission (prompt, plus a resumed stream's output)."""
    num_cached_tokens: int = 0
    """Of them, those taken from the cache instead of computed."""


class PrefixCache:
    """The scheduler's side of prefix caching over a BlockManager's names; `enabled` False
    (--no-prefix-caching): nothing is named or looked up (the n > 1 fork shares blocks still)."""

    def __init__(self, block_manager: BlockManager, salt: str, enabled: bool) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.root = root_hash(salt)
        self.enabled = enabled
        self.stats = PrefixCacheStats()

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """seq's block names, at least num_blocks of them (blocks wholly within its tokens)."""
        names = seq.block_hashes
        if len(names) < num_blocks:
            end = num_blocks * self.block_size
            parent = names[-1] if names else self.root
            tokens = seq.token_slice(0, end)
            names += chain_hashes(parent, tokens, self.block_size, len(names), num_blocks)
        return names

    def lookup(self, seq: Sequence) -> tuple[list[int], int]:
        """The cached blocks a waiting seq may start from, and how many of its tokens they hold
        for it: the longest cached prefix, short of its last token (one token is always
        computed, so that the last stage has logits to sample from). A request for its prompt's
        log-probabilities computes every token (the last stage scores them as they pass)."""
        if not self.enabled or seq.params.sampling.prompt_logprobs is not None:
            return [], 0
        num_full = seq.num_tokens // self.block_size
        if not num_full:
            return [], 0
        blocks = self.block_manager.cached_prefix(self.hashes(seq, num_full))
        return blocks, min(len(blocks) * self.block_size, seq.num_tokens - 1)

    def register(self, seq: Sequence) -> None:
        """Names seq's full blocks that are computed, or computed by a micro-batch already built
        (stages run micro-batches in order, so any later one that reads them finds them
        written), and not named yet. A decode gone ahead computes a position whose token the
        scheduler does not know yet: names stop at the known tokens."""
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = seq.num_named_blocks
        if not self.enabled or num_full <= start:
            return
        names = self.hashes(seq, num_full)
        register = self.block_manager.register
        block_ids = seq.block_ids
        for i in range(start, num_full):
            register(block_ids[i], names[i])
        seq.num_named_blocks = num_full

    def count_admission(self, seq: Sequence, num_cached_tokens: int) -> None:
        """Counts seq's first admission, which starts num_cached_tokens in."""
        if not self.enabled or seq.first_scheduled_time is not None:
            return
        stats = self.stats
        stats.num_requests += 1
        stats.num_prompt_tokens += seq.num_tokens
        if num_cached_tokens:
            stats.num_hit_requests += 1
            stats.num_cached_tokens += num_cached_tokens

    def check_names(self, seq: Sequence) -> None:
        """Raises AssertionError if a named block of seq holds other tokens than its name says,
        or is named before it is computed: a wrong hit (for tests; recomputes every name)."""
        bs = self.block_size
        num_full = min(len(seq.block_ids), seq.num_tokens // bs)
        names = chain_hashes(self.root, seq.token_slice(0, seq.num_tokens), bs, 0, num_full)
        for i, block_id in enumerate(seq.block_ids):
            name = self.block_manager.hash_of(block_id)
            if name is None:
                continue
            assert (i + 1) * bs <= seq.num_computed_tokens, f"{seq}: block {i} named uncomputed"
            assert i < len(names) and name == names[i], f"{seq}: block {i} holds another prefix"
