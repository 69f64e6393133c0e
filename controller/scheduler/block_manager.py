"""Paged KV-cache accounting: which block ids are free, and which are shared by several
sequences. The workers hold the blocks themselves."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class BlockManager:
    """A free list of KV-cache block ids, shared by every layer and every stage.

    Every worker keeps the same number of blocks for its own layers, so one block id names the
    same slot on every stage and TP rank; the controller hands ids out, the workers write into them.

    A block may have several holders (the n sequences of one request share their prompt's full
    blocks): it is free again when the last one lets go. Shared blocks are only read: a holder
    that needs to write into a block it shares gets a copy of it first (copy-on-write; the
    scheduler copies the one partial block at the fork, so no shared block is ever written).
    """

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        # A stack: recently freed blocks are reused first (they are warm in caches).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._extra_holders: dict[int, int] = {}
        """Holders beyond the first, for shared blocks only (empty without n > 1)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def can_admit(self, num_blocks: int) -> bool:
        """Whether a new sequence may take num_blocks and still leave the watermark free."""
        return len(self._free) - num_blocks >= self.watermark_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        if num_blocks == 0:
            return []
        taken = self._free[-num_blocks:]
        del self._free[-num_blocks:]
        taken.reverse()
        return taken

    def allocate_one(self) -> int:
        return self._free.pop()

    def share(self, block_ids: Iterable[int]) -> None:
        """One more holder for each of these blocks (held already)."""
        extra = self._extra_holders
        for block_id in block_ids:
            extra[block_id] = extra.get(block_id, 0) + 1

    def free(self, block_ids: Iterable[int]) -> None:
        """One holder lets go of each block; a block nobody holds any more is free."""
        extra = self._extra_holders
        if not extra:  # nothing is shared: the usual case, without a Python loop
            self._free.extend(block_ids)
            return
        for block_id in block_ids:
            others = extra.get(block_id)
            if others is None:
                self._free.append(block_id)
            elif others == 1:
                del extra[block_id]
            else:
                extra[block_id] = others - 1

    def check_invariants(self, held: Iterable[list[int]]) -> None:
        """Raises AssertionError unless every block is either free or held by as many owners as
        it counts (one, or more when shared)."""
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
        assert not free & seen, f"blocks both free and held: {sorted(free & seen)[:8]}"
        assert len(free) + len(seen) == self.num_blocks, (
            f"{self.num_blocks - len(free) - len(seen)} blocks leaked"
        )
        assert all(0 <= b < self.num_blocks for b in free | seen), "block id out of range"
