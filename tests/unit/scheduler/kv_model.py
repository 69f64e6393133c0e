"""A fake stage worker that computes from a modelled KV cache, for tests of KV block management.

The fake model of factories.py makes a token of (sequence, position) alone, so it cannot tell
a right KV block from a wrong one. This worker keeps what each block's slots hold, writes each
chunk's tokens into the sequence's block table as a stage writes keys and values, and samples
a token from the tokens it reads back from those blocks. A prefix-cache block named for other
tokens, a copy-on-write not made, a block reused while another sequence still reads it: each
changes what is read back, so a later token, and the output differs from the one the prompt
alone gives (ideal_output). Writing over a slot another live sequence has computed is caught
where it happens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from controller.scheduler import MicroBatch, ScheduledChunk

VOCAB = 40


def next_token(seed: int, tokens: Sequence[int]) -> int:
    """The fake model: a token of the whole context and the sequence's seed (tuples of ints hash
    the same in every process)."""
    return hash((seed, tuple(tokens))) % VOCAB


def ideal_output(
    prompt: Sequence[int], seed: int, max_tokens: int, stop_ids: frozenset[int]
) -> list[int]:
    """The output the fake model gives the prompt, whatever the cache did."""
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token(seed, [*prompt, *out]))
        if out[-1] in stop_ids:
            break
    return out


@dataclass
class SeqOnWorker:
    block_table: list[int]
    computed: int
    seed: int
    last_sampled: int | None = None


@dataclass
class KVWorker:
    """Runs micro-batches in the order given, as a single stage does."""

    block_size: int
    slots: dict[int, list[int | None]] = field(default_factory=dict)
    """Block id -> the token each of its slots holds (None: never written)."""
    seqs: dict[int, SeqOnWorker] = field(default_factory=dict)

    def run(self, batch: MicroBatch) -> dict[int, int]:
        """Computes one micro-batch: forgets its finished sequences, makes its block copies,
        then each chunk; returns the sampled token of each yielding chunk."""
        for seq_id in batch.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for src, dst in batch.block_copies:
            self.slots[dst] = list(self.slots.get(src, [None] * self.block_size))
        sampled = {}
        for chunk in batch.chunks:
            seq = self._seq(batch.batch_id, chunk)
            inputs = list(chunk.token_ids)
            if chunk.ahead:  # its input is the token this worker sampled last
                assert seq.last_sampled is not None, f"{chunk.seq_id} ahead of any token"
                inputs = [seq.last_sampled]
            for offset, token in enumerate(inputs):
                self._write(chunk.seq_id, seq, chunk.first_position + offset, token)
            seq.computed += chunk.num_tokens
            if chunk.yields_token:
                context = [self._read(seq, p) for p in range(chunk.context_len)]
                seq.last_sampled = sampled[chunk.seq_id] = next_token(seq.seed, context)
        return sampled

    def _seq(self, batch_id: int, chunk: ScheduledChunk) -> SeqOnWorker:
        """The sequence's state, new (with its block table) where the chunk carries sampling."""
        if chunk.sampling is not None:
            seq = SeqOnWorker(list(chunk.new_block_ids), chunk.first_position, chunk.sampling.seed)
            self.seqs[chunk.seq_id] = seq
        else:
            seq = self.seqs[chunk.seq_id]
            seq.block_table.extend(chunk.new_block_ids)
        assert chunk.first_position == seq.computed, (batch_id, chunk.seq_id, seq.computed)
        assert chunk.context_len <= len(seq.block_table) * self.block_size, (batch_id, chunk)
        return seq

    def _write(self, seq_id: int, seq: SeqOnWorker, position: int, token: int) -> None:
        block = seq.block_table[position // self.block_size]
        slot = position % self.block_size
        held = self.slots.setdefault(block, [None] * self.block_size)
        if held[slot] is not None and held[slot] != token:
            for other_id, other in self.seqs.items():
                if other_id != seq_id and block in other.block_table:
                    start = other.block_table.index(block) * self.block_size
                    assert start + slot >= other.computed, (
                        f"sequence {seq_id} writes over block {block} slot {slot}, which "
                        f"sequence {other_id} has computed"
                    )
        held[slot] = token

    def _read(self, seq: SeqOnWorker, position: int) -> int:
        token = self.slots[seq.block_table[position // self.block_size]][position % self.block_size]
        assert token is not None, f"position {position} read before it was written"
        return token
