"""Metrics of a live run, from what the client saw and what the stages reported."""

from __future__ import annotations

from sarathictl.bench.live_load import LiveRecord, LiveRun, scale_requests

from controller.executor.simulated import SimRequest


def test_live_metrics_use_client_token_times_and_stage_busy_seconds() -> None:
    records = [
        LiveRecord(arrival_s=0.0, first_token_s=0.5, scheduling_delay_s=0.1,
                   num_prompt_tokens=10, num_output_tokens=3, gaps_s=[0.1, 0.3]),
        LiveRecord(arrival_s=1.0, first_token_s=1.2, scheduling_delay_s=0.3,
                   num_prompt_tokens=20, num_output_tokens=2, gaps_s=[0.2]),
    ]  # fmt: skip
    run = LiveRun(records, start_s=0.0, end_s=2.0, stage_busy_s=[1.0, 1.5], num_preemptions=0)
    m = run.metrics()
    assert m.num_requests == 2 and not m.stopped_early
    assert m.ttft_p50_s == 0.35  # (0.5 + 0.2) / 2
    assert m.scheduling_delay_p50_s == 0.2
    assert m.tbt_p50_s == 0.2  # every gap is a sample: 0.1, 0.2, 0.3
    assert m.stage_utilization == (0.5, 0.75)
    assert m.bubble_fraction == 0.375
    assert m.throughput_tokens_s == 17.5


def test_a_failed_request_fails_the_run() -> None:
    run = LiveRun([LiveRecord(arrival_s=0.0, error="UNAVAILABLE: down")], 0.0, 1.0, [0.5], 0)
    assert run.num_errors == 1 and run.metrics().stopped_early
    assert not run.metrics().meets(tbt_slo_s=10.0)


def test_scaling_a_trace_keeps_every_request_at_least_one_token_and_within_the_cap() -> None:
    scaled = scale_requests([SimRequest(0.0, 1000, 100), SimRequest(1.0, 2, 1)], 0.1, 50)
    assert scaled == [SimRequest(0.0, 40, 10), SimRequest(1.0, 1, 1)]
