"""Quarantine: the requests of a micro-batch that made a worker fail run alone until the one at
fault is found, so one bad request cannot fail every rebuilt pipeline in turn.

A step that raises on a worker (its StepFault) or a plan the workers refuse takes the pipeline
down, and everything admitted is recomputed on the rebuilt one. A request that fails its step
every time (a bug only it triggers) would fail each rebuild again, first in line, and every other
request would stall behind it. So each fault counts against the sequences of the failed
micro-batch (`Sequence.num_step_faults`):

- A sequence that was alone in the failed micro-batch and had failed before ends with
  FinishReason.ERROR, and so does one in MAX_STEP_FAULTS failed micro-batches (a fault that needs
  company, e.g. an n > 1 request's choices, which run together).
- The others are suspects. Before anything else is admitted again, each suspect runs alone, oldest
  first: from its recompute through the chunk that failed and one position past it (`clear_at`).
  Passing, it is cleared and preempted, to rejoin the queue where it arrived; failing, it fails
  alone. An n > 1 request's choices still waiting for their leader's prompt compute it
  themselves after the trials rather than fork from the leader on trial.

A fault that is not a request's (a transient error) costs each suspect a trial and a second
recompute, and the queue the wait for their trials; a bad request costs one more rebuild.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from controller.scheduler.batch import MicroBatch
from controller.scheduler.sequence import Sequence

MAX_STEP_FAULTS = 3
"""Failed micro-batches a sequence may be in before it ends with an error, alone or not."""


class Quarantine:
    def __init__(self) -> None:
        self.suspects: dict[int, Sequence] = {}
        """By seq id."""
        self.clear_at: dict[int, int] = {}
        """Each suspect's trial is passed once a chunk of it ending here has come back: one
        position past the furthest chunk of it that failed."""
        self.on_trial: Sequence | None = None
        """The suspect running alone now; no other sequence is admitted meanwhile."""
        self.trial_end = 0
        """The furthest end of a chunk of the one on trial that has come back in its trial."""
        self.lost: dict[int, MicroBatch] = {}
        """The micro-batches in flight when the pipeline last went down, by batch id, but those
        judged: a fault report may arrive after the requeue (the executor saw the worker gone
        first)."""
        self.num_convicted = 0
        """Sequences ended with an error since start."""
        self._judged: set[int] = set()
        """Batches judged since the pipeline last went down: each TP rank of a stage runs the
        same step and reports the same fault, which counts once."""

    @property
    def active(self) -> bool:
        return bool(self.suspects)

    def judge(self, batch: MicroBatch, live: Mapping[int, Sequence]) -> list[Sequence]:
        """Counts batch's failure (once) against each of its live sequences. Returns those that
        end with an error (no longer suspects); the others are suspects now. Any trial under
        way ends: the rebuild requeues everything, and the trials start again."""
        if batch.batch_id in self._judged:
            return []
        self._judged.add(batch.batch_id)
        chunk_ends: dict[int, int] = {}  # seq id -> end of its furthest chunk in batch
        for chunk in batch.chunks:
            end = chunk.first_position + chunk.num_tokens
            chunk_ends[chunk.seq_id] = max(chunk_ends.get(chunk.seq_id, 0), end)
        # Alone: nothing else was in it, not even a sequence aborted since (the fault may be
        # that one's).
        alone = len(chunk_ends) == 1
        failed = []
        for seq in (live[seq_id] for seq_id in chunk_ends if seq_id in live):
            seq.num_step_faults += 1
            if (alone and seq.num_step_faults > 1) or seq.num_step_faults >= MAX_STEP_FAULTS:
                failed.append(seq)
                self.release(seq)
                self.num_convicted += 1
                continue
            self.suspects[seq.seq_id] = seq
            cleared = chunk_ends[seq.seq_id] + 1
            self.clear_at[seq.seq_id] = max(self.clear_at.get(seq.seq_id, 0), cleared)
        self.on_trial = None
        return failed

    def start_trial(self, seq: Sequence) -> None:
        self.on_trial, self.trial_end = seq, 0

    def returned(self, batch: MicroBatch) -> None:
        """batch's results are back: how far the one on trial got."""
        assert self.on_trial is not None
        seq_id = self.on_trial.seq_id
        for chunk in batch.chunks:
            if chunk.seq_id == seq_id:
                self.trial_end = max(self.trial_end, chunk.first_position + chunk.num_tokens)

    def trial_over(self) -> bool:
        """The one on trial has passed: its chunks are back through the failed chunk and one
        position more (a prompt's rest and one decode, or its recompute and one decode)."""
        assert self.on_trial is not None
        return self.trial_end >= self.clear_at[self.on_trial.seq_id]

    def next_suspect(self) -> Sequence | None:
        """The oldest suspect (suspects are live: the scheduler releases one that finishes)."""
        if not self.suspects:
            return None
        return min(self.suspects.values(), key=lambda seq: (seq.arrival_time, seq.seq_id))

    def release(self, seq: Sequence) -> None:
        """seq is a suspect no more (passed, failed, or finished otherwise)."""
        self.suspects.pop(seq.seq_id, None)
        self.clear_at.pop(seq.seq_id, None)
        if self.on_trial is seq:
            self.on_trial = None

    def remember_lost(self, batches: Iterable[MicroBatch]) -> None:
        self.lost = {b.batch_id: b for b in batches if b.batch_id not in self._judged}
        self._judged.clear()
