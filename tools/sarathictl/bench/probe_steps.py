"""What a live probe's steps cost, from the controller's step log (controller/step_log.py): the
micro-batches of decodes alone against those that carry prompt tokens, and the slowest one with
what it held. A probe's P99 TBT says that gaps were long; this says which steps made them, so
that a capacity on hardware at hand for minutes is explained by the run that measured it.

A micro-batch's time is its slowest stage's work (`work_s`: its plan off the socket to its
output sent, less any wait for the previous stage)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sarathictl.bench.step_log_lines import turnaround_s


@dataclass(frozen=True)
class StepTimes:
    """One kind of micro-batch in a probe: how many, and their times in ms."""

    count: int
    p50_ms: float
    p99_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> StepTimes | None:
        if not seconds:
            return None
        ms = np.asarray(seconds) * 1e3
        return cls(len(ms), float(np.median(ms)), float(np.percentile(ms, 99)))

    def describe(self, what: str) -> str:
        return f"{self.count} {what} p50 {self.p50_ms:.1f} / p99 {self.p99_ms:.1f} ms"


@dataclass(frozen=True)
class SlowestStep:
    ms: float
    prompt_tokens: int
    decodes: int
    positions_per_prompt_token: float
    """Keys each prompt token attended, on average: a later chunk of a long prompt attends all
    the prompt before it, a first chunk about half its own length."""

    def describe(self) -> str:
        held = [f"{self.decodes} decodes"]
        if self.prompt_tokens:
            held.insert(
                0,
                f"{self.prompt_tokens} prompt tokens attending "
                f"{self.positions_per_prompt_token:,.0f} positions each",
            )
        return f"slowest {self.ms:.1f} ms ({', '.join(held)})"


@dataclass(frozen=True)
class ProbeSteps:
    decode_only: StepTimes | None
    with_prompt: StepTimes | None
    slowest: SlowestStep | None
    turnaround_ms: float
    """Median time from a micro-batch's end to the start of the plan its result let the
    controller send (step_log_lines.turnaround_s), over the plans sent within 5 ms of a result
    (a plan sent later waited for work, not for the controller); 0 where none was."""

    def describe(self) -> str:
        """`812 decode-only p50 6.9 / p99 7.4 ms; 94 with prompt tokens p50 45.0 / p99 180.2
        ms; slowest 190.3 ms (512 prompt tokens attending 3,100 positions each, 3 decodes);
        turnaround 0.90 ms`"""
        parts = [
            kind.describe(what)
            for kind, what in (
                (self.decode_only, "decode-only"),
                (self.with_prompt, "with prompt tokens"),
            )
            if kind is not None
        ]
        if self.slowest is not None:
            parts.append(self.slowest.describe())
        if self.turnaround_ms:
            parts.append(f"turnaround {self.turnaround_ms:.2f} ms")
        return "; ".join(parts) if parts else "no steps logged"

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(lines: Sequence[dict[str, Any]]) -> ProbeSteps:
    """The step log's lines of one probe, summed up."""
    times = [max(s["work_s"] for s in line["stages"]) for line in lines]
    decode_only = [t for t, line in zip(times, lines, strict=True) if not line["prompt_tokens"]]
    with_prompt = [t for t, line in zip(times, lines, strict=True) if line["prompt_tokens"]]
    slowest = None
    if lines:
        i = int(np.argmax(times))
        line = lines[i]
        tokens = line["prompt_tokens"]
        slowest = SlowestStep(
            times[i] * 1e3,
            tokens,
            line["decodes"],
            line["prefill_pairs"] / tokens if tokens else 0.0,
        )
    return ProbeSteps(
        StepTimes.of(decode_only), StepTimes.of(with_prompt), slowest, turnaround_s(lines) * 1e3
    )
