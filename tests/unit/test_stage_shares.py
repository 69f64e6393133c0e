"""A stage's wall time split into utilization, bubble and idle, and what Prometheus gets of it."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from controller.metrics import ControllerMetrics
from controller.telemetry import StageShares, WorkWindow


def test_work_window_counts_only_time_with_work() -> None:
    work = WorkWindow(window_s=30.0)
    work.mark(0.0, False)
    work.mark(10.0, True)
    work.mark(14.0, False)  # 4 s of work
    work.mark(20.0, True)  # still open: 5 s more by t=25
    assert work.work_s(now=25.0, since=0.0) == pytest.approx(9.0)
    assert work.work_s(now=25.0, since=12.0) == pytest.approx(7.0)  # starts inside the first
    # Forty seconds on, only the window's last 30 s count: the open interval from 20 to 60.
    assert work.work_s(now=60.0, since=0.0) == pytest.approx(30.0)


def test_shares_split_the_window_and_add_up_to_one() -> None:
    # 30 s window: the pipeline had work for 20 s, the stage computed for 12 of them.
    shares = StageShares.of(busy_s=12.0, work_s=20.0, span_s=30.0)
    assert shares.utilization == pytest.approx(0.4)
    assert shares.bubble == pytest.approx(8 / 30)
    assert shares.idle == pytest.approx(10 / 30)
    assert shares.bubble_fraction == pytest.approx(8 / 20)


def test_busy_reported_after_the_work_ended_is_no_negative_bubble() -> None:
    shares = StageShares.of(busy_s=10.5, work_s=10.0, span_s=30.0)
    assert shares.bubble == 0.0
    assert shares.utilization + shares.idle == pytest.approx(1.0)
    assert StageShares.of(0.0, 0.0, 0.0) == StageShares(0.0, 0.0, 1.0)


def _busy_seconds(metrics: ControllerMetrics) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith('sarathi:stage_busy_seconds_total{stage="0"}'):
            return float(line.split()[-1])
    raise AssertionError("no busy-seconds sample for stage 0")


def test_busy_seconds_keep_counting_across_a_rebuilt_stage() -> None:
    metrics = ControllerMetrics()
    shares = [StageShares.of(1.0, 2.0, 3.0)]
    metrics.on_stages(shares, [5.0])
    metrics.on_stages(shares, [7.5])
    assert _busy_seconds(metrics) == pytest.approx(7.5)
    metrics.on_stages(shares, [1.0])  # the stage's workers restarted and count from zero
    assert _busy_seconds(metrics) == pytest.approx(8.5)
