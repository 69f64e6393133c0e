"""The decode roster: every running sequence in its decode phase, held as columns.

A decoding sequence changes by one token per step, so the roster keeps its hot counters in numpy
vectors indexed by a slot (the way vLLM keeps a persistent batch) and a step touches all of them
with a few vector operations instead of Python work per sequence. While a sequence is on the
roster, its `num_computed_tokens`, `num_inflight_batches` and `last_token_time` live here (the
Sequence's properties read and write them); they go back to the Sequence when it leaves.

Membership: a running sequence is on the roster from the moment its next work is one decode token
(prompt computed, at least one output token) until it finishes or is preempted; in between its
uncomputed tokens are 1 (ready) or 0 (its decode is in flight), or -1 when a second decode went
ahead of the first's token (SchedulerConfig.decode_ahead).
"""

from __future__ import annotations

from array import array
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from controller.scheduler.sequence import Sequence

IntArray = npt.NDArray[np.int64]

# The counters a step changes: (name, array typecode, numpy dtype).
_COUNTERS = (
    ("computed", "q", np.int64),  # num_computed_tokens
    ("num_tokens", "q", np.int64),  # prompt plus output tokens
    ("inflight", "q", np.int64),  # num_inflight_batches
    ("kv_capacity", "q", np.int64),  # tokens the KV blocks hold: len(block_ids) * block_size
    ("last_token_time", "d", np.float64),
    ("passes", "q", np.int64),  # micro-batches that passed over its ready decode (PP > 1)
    ("last_token", "q", np.int64),  # output_token_ids[-1]: a decode's input token, for the wire
)


class DecodeRoster:
    def __init__(self, block_size: int, capacity: int = 64) -> None:
        self.block_size = block_size
        self.size = 0
        self.seq_ids: IntArray = np.full(capacity, -1, np.int64)
        """-1 marks a free slot."""
        self._alloc_counters(capacity)
        self.max_num_tokens: IntArray = np.zeros(capacity, np.int64)
        """Each member's Sequence.max_num_tokens, as a column."""
        self.admit_no: IntArray = np.zeros(capacity, np.int64)
        """Admission counter: the roster's order is the scheduler's `running` order."""
        self.num_leaves = 0
        self.num_passed = 0
        """Members whose `passes` is not 0 (each is ready: a decode that went clears it)."""
        """Sequences that ever left: while it is unchanged, every slot holds the same sequence."""
        self.id_objs: npt.NDArray[np.object_] = np.empty(capacity, object)
        """seq_ids as Python ints, to hand out lists of them without creating ints."""
        self.seqs: npt.NDArray[np.object_] = np.empty(capacity, object)
        self.outputs: npt.NDArray[np.object_] = np.empty(capacity, object)
        """Each slot's output_token_ids list, so a step appends tokens without Python loops."""
        self.block_lists: npt.NDArray[np.object_] = np.empty(capacity, object)
        self._free_slots: list[int] = list(range(capacity - 1, -1, -1))
        self._order: IntArray | None = None
        self._stop_counts: Counter[int] = Counter()
        self._stop_ids: IntArray | None = None

    def _alloc_counters(self, capacity: int, old: DecodeRoster | None = None) -> None:
        """The per-step counters, each twice over the same memory: an array.array for code that
        reads or writes one slot (indexing it gives a Python int in about 35 ns, a numpy scalar
        costs about 140 ns) and a numpy view of it for vector operations. With old, copies its
        counters into the first slots."""
        for name, typecode, dtype in _COUNTERS:
            items = array(typecode, bytes(8 * capacity))
            column = np.frombuffer(items, dtype)
            if old is not None:
                previous = getattr(old, name)
                column[: len(previous)] = previous
            setattr(self, "py_" + name, items)
            setattr(self, name, column)

    # Set by _alloc_counters; see _COUNTERS.
    computed: IntArray
    py_computed: array[int]
    num_tokens: IntArray
    py_num_tokens: array[int]
    inflight: IntArray
    py_inflight: array[int]
    kv_capacity: IntArray
    py_kv_capacity: array[int]
    last_token_time: npt.NDArray[np.float64]
    py_last_token_time: array[float]
    passes: IntArray
    py_passes: array[int]
    last_token: IntArray
    py_last_token: array[int]

    # ---- membership -----------------------------------------------------------------------
    def join(self, seq: Sequence, admit_no: int) -> None:
        """Puts seq (running, next work one decode token) on the roster."""
        assert seq._roster is None, seq
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        self.seq_ids[slot] = seq.seq_id
        self.py_computed[slot] = seq._num_computed_tokens
        self.py_num_tokens[slot] = seq.num_tokens
        self.py_inflight[slot] = seq._num_inflight_batches
        self.py_kv_capacity[slot] = len(seq.block_ids) * self.block_size
        self.max_num_tokens[slot] = seq.max_num_tokens
        self.admit_no[slot] = admit_no
        last = seq._last_token_time
        self.py_last_token_time[slot] = 0.0 if last is None else last
        self.py_passes[slot] = 0
        self.py_last_token[slot] = seq.output_token_ids[-1]
        self.id_objs[slot] = seq.seq_id
        self.seqs[slot] = seq
        self.outputs[slot] = seq.output_token_ids
        self.block_lists[slot] = seq.block_ids
        seq._roster = self
        seq._slot = slot
        self.size += 1
        self._order = None
        if seq.stop_token_ids:
            self._stop_counts.update(seq.stop_token_ids)
            self._stop_ids = None

    def leave(self, seq: Sequence) -> None:
        """Takes seq off the roster, its counters back into the Sequence."""
        assert seq._roster is self, seq
        slot = seq._slot
        seq._num_computed_tokens = self.py_computed[slot]
        seq._num_inflight_batches = self.py_inflight[slot]
        seq._last_token_time = self.py_last_token_time[slot]
        if self.py_passes[slot]:
            self.py_passes[slot] = 0
            self.num_passed -= 1
        seq._roster = None
        seq._slot = -1
        self.seq_ids[slot] = -1
        self.id_objs[slot] = None
        self.seqs[slot] = None
        self.outputs[slot] = None
        self.block_lists[slot] = None
        self._free_slots.append(slot)
        self.size -= 1
        self.num_leaves += 1
        self._order = None
        if seq.stop_token_ids:
            self._stop_counts.subtract(seq.stop_token_ids)
            self._stop_counts = +self._stop_counts  # drops ids no member stops at any more
            self._stop_ids = None

    def _grow(self) -> None:
        old = len(self.seq_ids)
        new = old * 2
        self._alloc_counters(new, old=self)
        for name in (
            "seq_ids",
            "max_num_tokens",
            "admit_no",
            "id_objs",
            "seqs",
            "outputs",
            "block_lists",
        ):
            arr = getattr(self, name)
            grown = np.empty(new, arr.dtype)
            grown[:old] = arr
            grown[old:] = -1 if name == "seq_ids" else (None if arr.dtype == object else 0)
            setattr(self, name, grown)
        self._free_slots = list(range(new - 1, old - 1, -1)) + self._free_slots

    # ---- views ----------------------------------------------------------------------------
    def order(self) -> IntArray:
        """Occupied slots in admission order (cached until membership changes)."""
        order = self._order
        if order is None:
            slots = np.flatnonzero(self.seq_ids >= 0)
            order = slots[np.argsort(self.admit_no[slots], kind="stable")]
            self._order = order
        return order

    def stop_ids(self) -> IntArray:
        """Every stop token id of any member (empty when none has one)."""
        ids = self._stop_ids
        if ids is None:
            ids = np.fromiter(self._stop_counts, np.int64, len(self._stop_counts))
            self._stop_ids = ids
        return ids

    def check_invariants(self) -> None:
        """Raises AssertionError if a slot and its Sequence disagree (for tests)."""
        slots = np.flatnonzero(self.seq_ids >= 0)
        assert len(slots) == self.size == len(self.seq_ids) - len(self._free_slots)
        for name, _, _ in _COUNTERS:
            items, column = getattr(self, "py_" + name), getattr(self, name)
            assert len(items) == len(column) == len(self.seq_ids), name
            assert np.shares_memory(column, np.frombuffer(items, column.dtype)), name
        for slot in slots.tolist():
            seq = self.seqs[slot]
            assert seq._roster is self and seq._slot == slot, seq
            assert self.seq_ids[slot] == seq.seq_id == self.id_objs[slot], seq
            assert self.num_tokens[slot] == seq.num_tokens, seq
            # -1: a decode gone ahead (SchedulerConfig.decode_ahead) computes the position of
            # the token its decode in flight yields.
            assert -1 <= seq.num_tokens - self.computed[slot] <= 1, seq
            assert self.outputs[slot] is seq.output_token_ids and seq.output_token_ids, seq
            assert self.last_token[slot] == seq.output_token_ids[-1], seq
            assert self.block_lists[slot] is seq.block_ids, seq
            assert self.kv_capacity[slot] == len(seq.block_ids) * self.block_size, seq
            assert self.max_num_tokens[slot] == seq.max_num_tokens, seq
            passes = self.passes[slot]
            assert passes >= 0 and (not passes or self.computed[slot] < seq.num_tokens), seq
        assert self.num_passed == np.count_nonzero(self.passes[slots])
        assert set(self._stop_counts) == {
            t for slot in slots.tolist() for t in self.seqs[slot].stop_token_ids
        }
