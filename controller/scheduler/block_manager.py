"""Paged KV-cache accounting: which block ids are free, which are held and by how many, and
which hold a cached prefix (named by its hash). The workers hold the blocks themselves."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable


class BlockManager:
    """KV-cache block ids, shared by every layer and every stage.

    Every worker keeps the same number of blocks for its own layers, so one block id names the
    same slot on every stage and TP rank; the controller hands ids out, the workers write into them.

    A block may have several holders (sequences that share a prompt prefix: a cache hit, or the
    n sequences of one request): it is free again when the last one lets go. Shared blocks are
    only read: a holder that needs to write into a block it shares gets a copy of it first
    (copy-on-write; the scheduler copies the block at the sharing point, so no shared block is
    ever written).

    Prefix caching: a full, computed block may be named by the hash of its prefix (`register`);
    a new sequence finds its longest named prefix (`cached_prefix`) and holds those blocks
    instead of computing them. A named block nobody holds stays cached in an LRU queue and is
    evicted (loses its name) only when a block is needed and no unnamed one is free.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        # A stack of free unnamed blocks: recently freed ones are reused first (warm in caches).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._extra_holders: dict[int, int] = {}
        """Holders beyond the first, for shared blocks only (empty without sharing)."""
        self._evictable: OrderedDict[int, bytes] = OrderedDict()
        """Named blocks nobody holds, least recently used first: free, but still cached."""
        self._block_by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.num_evictions = 0
        """Named blocks that lost their name to make room, since start."""

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: unnamed free ones, then cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks named by a prefix hash, held or not."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        """Share of blocks held by a sequence, in [0, 1] (cached blocks nobody holds are free)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def can_admit(self, num_blocks: int) -> bool:
        """Whether a new sequence may take num_blocks and still leave the watermark free."""
        return self.num_free - num_blocks >= self.watermark_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free} free")
        if num_blocks == 0:
            return []
        free = self._free
        if num_blocks <= len(free):
            taken = free[-num_blocks:]
            del free[-num_blocks:]
            taken.reverse()
            return taken
        return [self.allocate_one() for _ in range(num_blocks)]

    def allocate_one(self) -> int:
        if self._free:
            return self._free.pop()
        block_id, block_hash = self._evictable.popitem(last=False)  # least recently used
        del self._block_by_hash[block_hash]
        del self._hash_of[block_id]
        self.num_evictions += 1
        return block_id

    def hold(self, block_ids: Iterable[int]) -> None:
        """One more holder for each of these blocks: held already (a fork), or cached (a hit)."""
        extra = self._extra_holders
        evictable = self._evictable
        for block_id in block_ids:
            if evictable.pop(block_id, None) is None:
                extra[block_id] = extra.get(block_id, 0) + 1

    def num_unheld(self, block_ids: Iterable[int]) -> int:
        """How many of these cached blocks nobody holds (holding them takes them off num_free)."""
        evictable = self._evictable
        return sum(1 for block_id in block_ids if block_id in evictable)

    def free(self, block_ids: list[int]) -> None:
        """One holder lets go of each block; a block nobody holds any more is free (cached still
        when it is named). Named blocks are queued last first: a prefix's tail is evicted before
        its head, which later prefixes share more often."""
        extra = self._extra_holders
        if not extra and not self._hash_of:  # nothing is shared or cached: no Python loop
            self._free.extend(block_ids)
            return
        hash_of = self._hash_of
        for block_id in reversed(block_ids):
            others = extra.get(block_id)
            if others is None:
                block_hash = hash_of.get(block_id)
                if block_hash is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = block_hash
            elif others == 1:
                del extra[block_id]
            else:
                extra[block_id] = others - 1

    # ---- prefix cache -----------------------------------------------------------------------
    def cached_prefix(self, block_hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest run of these prefix hashes, from the first."""
        found: list[int] = []
        by_hash = self._block_by_hash
        for block_hash in block_hashes:
            block_id = by_hash.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Names a held block, full and computed (or being computed by a micro-batch already
        built), by its prefix hash. A block with that hash cached already keeps the name (this
        one stays unnamed: freed as any other); a named block keeps its name."""
        if block_hash in self._block_by_hash or block_id in self._hash_of:
            return
        self._block_by_hash[block_hash] = block_id
        self._hash_of[block_id] = block_hash

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def drop_cache(self) -> int:
        """Forgets every name (the workers lost their KV): cached blocks nobody holds become plain
        free blocks, held ones stay held. Returns the number of blocks that were named."""
        dropped = len(self._hash_of)
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._block_by_hash.clear()
        self._hash_of.clear()
        return dropped

    def check_invariants(self, held: Iterable[list[int]]) -> None:
        """Raises AssertionError unless every block is exactly one of: free and unnamed, cached
        and held by nobody, or held by as many owners as it counts (one, or more when shared);
        and the names map both ways."""
        counts: Counter[int] = Counter()
        for block_ids in held:
            counts.update(block_ids)
        seen = set(counts)
        for block_id, num in counts.items():
            extra = self._extra_holders.get(block_id, 0)
            assert num == 1 + extra, f"block {block_id} held {num} times, counted {1 + extra}"
        assert not self._extra_holders.keys() - seen, "a shared block nobody holds"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        evictable = set(self._evictable)
        assert not free & seen, f"blocks both free and held: {sorted(free & seen)[:8]}"
        assert not evictable & seen, f"blocks both cached-free and held: {sorted(evictable)[:8]}"
        assert not free & evictable, "a block both free and cached-free"
        assert len(free) + len(evictable) + len(seen) == self.num_blocks, (
            f"{self.num_blocks - len(free) - len(evictable) - len(seen)} blocks leaked"
        )
        assert all(0 <= b < self.num_blocks for b in free | seen), "block id out of range"
        assert not free & self._hash_of.keys(), "a named block on the unnamed free list"
        for block_id, block_hash in self._evictable.items():
            assert self._hash_of.get(block_id) == block_hash, f"cached block {block_id} unnamed"
        assert len(self._block_by_hash) == len(self._hash_of), "names do not map both ways"
        for block_hash, block_id in self._block_by_hash.items():
            assert self._hash_of.get(block_id) == block_hash, f"block {block_id} misnamed"
