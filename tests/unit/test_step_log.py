"""--step-log: a micro-batch's line holds its composition and each stage's own time, is written
only once its result and every stage's report are in, and the calibration reads it back as
profile rows and the controller's turnaround."""

from __future__ import annotations

import io
import json

import pytest
from sarathictl.bench.calibrate import profile_rows
from sarathictl.bench.step_log_lines import turnaround_s

from controller.scheduler import MicroBatch, ScheduledChunk
from controller.scheduler.step_cost import attended
from controller.step_log import StepLog


def batch(batch_id: int) -> MicroBatch:
    prompt = ScheduledChunk(10, 16, 32, True, (), [0] * 32, None)  # positions 16-47
    decode = ScheduledChunk(11, 99, 1, True, (), [0], None)  # reads 100 keys
    return MicroBatch(batch_id, [prompt, decode], [], 33)


def lines(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_line_per_micro_batch_once_every_stage_and_the_result_are_in() -> None:
    out = io.StringIO()
    log = StepLog(out, num_stages=2, opened_at=100.0)
    log.sent(batch(1), at=100.5)
    # Cumulative totals: stage 0 ran 0.030 s, stage 1 0.045 s of which 0.010 s waiting.
    log.stage_reported(0, 1, step_s=0.030, prepare_s=0.001, recv_wait_s=0.0)
    log.returned(1, at=100.6)
    assert out.getvalue() == ""  # stage 1 has not reported yet
    log.stage_reported(1, 1, step_s=0.045, prepare_s=0.002, recv_wait_s=0.010)
    (line,) = lines(out)
    assert line["batch_id"] == 1
    assert (line["prompt_tokens"], line["decodes"]) == (32, 1)
    assert line["prefill_pairs"] == attended(16, 32)
    assert line["decode_keys"] == 100
    assert (line["sent_s"], line["returned_s"]) == (pytest.approx(0.5), pytest.approx(0.6))
    assert line["opened_at_s"] + line["sent_s"] == pytest.approx(100.5)  # the clock's own reading
    assert [s["work_s"] for s in line["stages"]] == pytest.approx([0.030, 0.035])


def test_each_step_is_the_difference_of_two_reports_and_idle_repeats_are_ignored() -> None:
    out = io.StringIO()
    log = StepLog(out, num_stages=1)
    for batch_id, step_s in ((1, 0.020), (2, 0.050)):
        log.sent(batch(batch_id), at=0.0)
        log.stage_reported(0, batch_id, step_s=step_s, prepare_s=0.0, recv_wait_s=0.0)
        log.stage_reported(0, batch_id, step_s=step_s, prepare_s=0.0, recv_wait_s=0.0)  # idle
        log.returned(batch_id, at=0.1)
    assert [line["stages"][0]["work_s"] for line in lines(out)] == pytest.approx([0.020, 0.030])


def test_batches_lost_to_a_rebuild_are_never_written_and_counting_restarts() -> None:
    out = io.StringIO()
    log = StepLog(out, num_stages=1)
    log.sent(batch(1), at=0.0)
    log.forget_in_flight()
    log.returned(1, at=0.1)
    log.stage_reported(0, 1, step_s=5.0, prepare_s=0.0, recv_wait_s=0.0)
    assert out.getvalue() == ""
    log.sent(batch(2), at=0.2)
    log.forget_in_flight()  # the rebuilt worker's totals start from 0 again
    log.sent(batch(3), at=0.3)
    log.stage_reported(0, 3, step_s=0.040, prepare_s=0.0, recv_wait_s=0.0)
    log.returned(3, at=0.4)
    assert [line["stages"][0]["work_s"] for line in lines(out)] == pytest.approx([0.040])


def step_line(batch_id: int, sent: float, works: list[float], start: float) -> dict:
    """A step log line whose stages run back to back from `start` and whose result comes back
    0.2 ms after the last one ends."""
    stages, t = [], start
    for work in works:
        t += work
        stages.append({"work_s": work, "prepare_s": 0.0, "recv_wait_s": 0.0, "reported_s": t})
    return {"batch_id": batch_id, "sent_s": sent, "returned_s": t + 0.0002,
            "prompt_tokens": 0, "decodes": 4, "prefill_pairs": 0, "decode_keys": 400,
            "stages": stages}  # fmt: skip


def test_rows_are_the_stages_mean_and_the_turnaround_is_result_to_next_start() -> None:
    # PP 1, pipeline full: each plan goes out 0.3 ms after the result before it and its stage
    # starts 0.5 ms after that, so 1 ms from one step's end to the next's start.
    steps, end = [], 0.0
    for i in range(5):
        sent = end + 0.0005 if i else 0.0  # the result came back at end + 0.2 ms
        start = sent + 0.0005
        steps.append(step_line(i + 1, sent, [0.010], start))
        end = start + 0.010
    assert turnaround_s(steps) == pytest.approx(0.0010)
    two = step_line(9, 0.0, [0.010, 0.030], 0.0)
    assert profile_rows([two]) == [(0, 4, 0, 400, pytest.approx(0.020))]
    lone = [step_line(i, i * 1.0, [0.01], i * 1.0) for i in range(3)]  # nothing waited
    assert turnaround_s(lone) == 0.0


def test_a_line_counts_the_tokens_its_new_sequences_took_from_the_prefix_cache() -> None:
    from controller.scheduler import RequestParams
    from tests.unit.scheduler.factories import FakePipeline, create_scheduler

    sched = create_scheduler(budget_tokens=64)
    system = list(range(500, 540))  # 2 full blocks of 16
    sched.add_request(1, [*system, 1], RequestParams(max_tokens=1), 0.0)
    FakePipeline(sched).run_to_completion()
    sched.add_request(2, [*system, 2, 3], RequestParams(max_tokens=1), 0.0)
    hit = sched.schedule(0.0)
    assert hit is not None
    out = io.StringIO()
    log = StepLog(out, num_stages=1)
    log.sent(hit, at=0.0)
    log.stage_reported(0, hit.batch_id, step_s=0.01, prepare_s=0.0, recv_wait_s=0.0)
    log.returned(hit.batch_id, at=0.02)
    (line,) = lines(out)
    assert (line["cached_tokens"], line["prompt_tokens"]) == (32, 10)  # 42 tokens, 32 cached
