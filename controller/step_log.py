"""`--step-log FILE`: one JSON line per micro-batch, for calibrating the simulator on a live
pipeline (sarathictl.bench.calibrate), for what a live capacity probe's steps cost
(sarathictl.bench.probe_steps) and for seeing where one step's time went.

A line is written once the micro-batch's result is back and every stage has reported it (the
heartbeat a worker sends after each step). It holds what the cost model reads of a micro-batch
(scheduler/step_cost.py micro_batch_features) and, per stage, the step's own time from the worker's
cumulative phases (generate.proto StepPhases, differenced between two steps):
- `work_s`: plan off the socket to output sent, less the wait for the previous stage;
- `prepare_s`, `recv_wait_s`: parsing the plan, and waiting for the activations;
- `reported_s`: when the controller read the heartbeat.
`cached_tokens` counts the tokens that sequences started in the micro-batch took from the prefix
cache instead of computing them (the prompt tokens above are the computed ones).
`sent_s` and `returned_s` are the controller's: plans out, result in. Every time is seconds on
the controller's clock (step_phases.clock) since the log was opened; `opened_at_s` is that
clock's reading then, so that adding it gives perf_counter() seconds, which other processes
on the machine read alike (CLOCK_MONOTONIC on Linux): bench_vs_vllm lines the stages' steps up
with its client's request times by it.

Lines of batches lost to a pipeline rebuild are never written (`forget_in_flight`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import IO, Any

from controller.scheduler import MicroBatch
from controller.scheduler.step_cost import micro_batch_features
from controller.step_phases import clock

_MAX_PENDING = 4096
"""Batches waiting for a stage's report; a worker that never reports one cannot grow this."""


@dataclass
class _StageTotals:
    step_s: float = 0.0
    prepare_s: float = 0.0
    recv_wait_s: float = 0.0
    last_batch_id: int = 0


@dataclass
class _Pending:
    line: dict[str, Any]
    stages: list[dict[str, float] | None]
    returned: bool = False


@dataclass
class StepLog:
    out: IO[str]
    num_stages: int
    opened_at: float = field(default_factory=clock)
    _pending: dict[int, _Pending] = field(default_factory=dict)
    _totals: dict[int, _StageTotals] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str, num_stages: int) -> StepLog:
        return cls(open(path, "a", buffering=1), num_stages)  # line-buffered: readable live

    def _now(self, at: float) -> float:
        return round(at - self.opened_at, 6)

    def sent(self, batch: MicroBatch, at: float) -> None:
        prompt_tokens, decodes, prefill_pairs, decode_keys = micro_batch_features(batch)
        line = {"batch_id": batch.batch_id, "opened_at_s": self.opened_at,
                "sent_s": self._now(at), "prompt_tokens": prompt_tokens, "decodes": decodes,
                "prefill_pairs": prefill_pairs, "decode_keys": decode_keys,
                "cached_tokens": batch.num_cached_tokens}  # fmt: skip
        if len(self._pending) >= _MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        self._pending[batch.batch_id] = _Pending(line, [None] * self.num_stages)

    def stage_reported(
        self, stage: int, batch_id: int, step_s: float, prepare_s: float, recv_wait_s: float
    ) -> None:
        """A heartbeat: the stage's cumulative phase totals after its step `batch_id`."""
        totals = self._totals.setdefault(stage, _StageTotals())
        if batch_id <= totals.last_batch_id:
            return  # an idle heartbeat repeats the last step
        work_s = (step_s - totals.step_s) - (recv_wait_s - totals.recv_wait_s)
        report = {"work_s": round(work_s, 6), "prepare_s": round(prepare_s - totals.prepare_s, 6),
                  "recv_wait_s": round(recv_wait_s - totals.recv_wait_s, 6),
                  "reported_s": self._now(clock())}  # fmt: skip
        self._totals[stage] = _StageTotals(step_s, prepare_s, recv_wait_s, batch_id)
        pending = self._pending.get(batch_id)
        if pending is not None:
            pending.stages[stage] = report
            self._write_if_complete(batch_id, pending)

    def returned(self, batch_id: int, at: float) -> None:
        pending = self._pending.get(batch_id)
        if pending is not None:
            pending.line["returned_s"] = self._now(at)
            pending.returned = True
            self._write_if_complete(batch_id, pending)

    def forget_in_flight(self) -> None:
        """The pipeline went down: its batches never return and the rebuilt workers count their
        phases from 0 again."""
        self._pending.clear()
        self._totals.clear()

    def _write_if_complete(self, batch_id: int, pending: _Pending) -> None:
        if pending.returned and all(s is not None for s in pending.stages):
            del self._pending[batch_id]
            self.out.write(json.dumps(pending.line | {"stages": pending.stages}) + "\n")
