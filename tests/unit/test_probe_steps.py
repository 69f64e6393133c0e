"""A probe's steps summed up from the controller's step log: decode-only micro-batches apart
from those with prompt tokens, a micro-batch timed by its slowest stage, and the slowest one
with what it held."""

from __future__ import annotations

from typing import Any

import pytest
from sarathictl.bench.probe_steps import summarize


def line(prompt: int, decodes: int, pairs: int, *stage_ms: float) -> dict[str, Any]:
    stages = [{"work_s": ms / 1e3, "reported_s": 0.0} for ms in stage_ms]
    return {"prompt_tokens": prompt, "decodes": decodes, "prefill_pairs": pairs,
            "sent_s": 0.0, "returned_s": 0.0, "stages": stages}  # fmt: skip


def test_decode_only_and_prompt_steps_apart_and_the_slowest_named() -> None:
    lines = [line(0, 4, 0, 7.0, 6.0) for _ in range(9)]
    lines += [line(0, 4, 0, 8.0, 9.0)]  # a stage's time is the slowest stage's
    # a 512-token chunk after 3,000 cached tokens: 512 * 3000 + 512 * 513 / 2 pairs
    lines += [line(512, 3, 512 * 3000 + 512 * 513 // 2, 20.0, 95.0)]
    lines += [line(64, 0, 64 * 65 // 2, 12.0, 11.0)]
    steps = summarize(lines)
    assert steps.decode_only is not None and steps.with_prompt is not None
    assert (steps.decode_only.count, steps.decode_only.p50_ms) == (10, pytest.approx(7.0))
    assert steps.decode_only.p99_ms == pytest.approx(9.0, abs=0.2)
    assert steps.with_prompt.count == 2
    assert steps.slowest is not None
    assert (steps.slowest.ms, steps.slowest.prompt_tokens, steps.slowest.decodes) == (
        pytest.approx(95.0),
        512,
        3,
    )
    assert steps.slowest.positions_per_prompt_token == pytest.approx(3000 + 513 / 2)
    text = steps.describe()
    assert "10 decode-only p50 7.0 / p99 8.8 ms" in text  # numpy interpolates the P99
    assert "2 with prompt tokens" in text
    assert "slowest 95.0 ms (512 prompt tokens attending 3,256 positions each, 3 decodes)" in text


def test_a_probe_without_steps_says_so() -> None:
    steps = summarize([])
    assert (steps.decode_only, steps.with_prompt, steps.slowest) == (None, None, None)
    assert steps.describe() == "no steps logged"
    assert steps.as_json()["slowest"] is None


def test_the_turnaround_is_from_a_result_to_the_next_plan_starting() -> None:
    # micro-batch 1 ends at 10.0 ms; the plan its result let the controller send starts on the
    # stage at 11.5 ms (reported at 21.5 ms after 10 ms of work): a 1.5 ms turnaround
    first = line(0, 4, 0, 10.0) | {"sent_s": 0.0, "returned_s": 0.0100}
    first["stages"][0]["reported_s"] = 0.0100
    second = line(0, 4, 0, 10.0) | {"sent_s": 0.0105, "returned_s": 0.0215}
    second["stages"][0]["reported_s"] = 0.0215
    steps = summarize([first, second])
    assert steps.turnaround_ms == pytest.approx(1.5)
    assert steps.describe().endswith("; turnaround 1.50 ms")
