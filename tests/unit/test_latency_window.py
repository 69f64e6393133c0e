"""The status latency window: percentiles over the last minute, in memory that follows the rate
over that minute, not the number of requests served (the soak drift of RELIABILITY.md)."""

from __future__ import annotations

import tracemalloc

from controller.telemetry import LatencyWindow


def feed(window: LatencyWindow, seconds: int, per_s: int) -> float:
    """`per_s` requests a second, each with a TTFT and three token gaps; returns the last time."""
    now = 0.0
    for i in range(seconds * per_s):
        now = i / per_s
        window.add_ttft(now, 0.001 * (i % 997))
        for _ in range(3):
            window.add_tbt(now, 0.0001 * (i % 89))
    return now


def test_percentiles_read_exactly_the_last_window() -> None:
    window = LatencyWindow(window_s=60.0)
    now = feed(window, seconds=300, per_s=20)
    recent = [i for i in range(300 * 20) if i / 20 >= now - 60.0]
    assert window.ttft(now) == sorted(0.001 * (i % 997) for i in recent)
    assert window.tbt(now) == sorted(0.0001 * (i % 89) for i in recent for _ in range(3))
    assert window.tokens_per_s(now, since=0.0) == len(recent) * 4 / 60.0


def test_memory_follows_the_window_not_the_requests_served() -> None:
    # 150,000 requests at 50 a second: a minute holds 3,000 of them (12,000 samples in all).
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        window = LatencyWindow(window_s=60.0)
        feed(window, seconds=3_000, per_s=50)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # Samples kept until 100,000 a series pushed them out held 19.8 MiB here; a minute, 1.2 MiB.
    assert held < 3 * 2**20, f"{held / 2**20:.1f} MiB held"
