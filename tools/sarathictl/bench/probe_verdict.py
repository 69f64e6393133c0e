"""When a live capacity probe may stop: its miss is already certain.

A probe fails when its P99 TBT is over the SLO or its median scheduling delay over 2 s
(capacity.py). Past capacity that is plain long before the last request ends: requests queue
for as long as they keep arriving and then the queue drains. On one CPU thread a probe of 16 s
of arrivals ran for 150 s that way, most of it after its miss was settled (BENCHMARKS.md, "The
live capacity search within a deadline"). `certain_miss` says, from what the client has seen so
far and the controller's count of unscheduled requests, when no later event can make the probe
pass, so that it can cancel what is left. It counts only what is sure, so a probe stopped here
would have failed had it run to its end.

Pure: no clock, no gRPC; live_load.py feeds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sarathictl.bench.capacity import MAX_MEDIAN_DELAY_S


@dataclass(frozen=True)
class ProbeBounds:
    """What a probe must meet, and how often the client asks the controller for its queue."""

    tbt_slo_s: float
    max_median_delay_s: float = MAX_MEDIAN_DELAY_S
    poll_s: float = 0.5


@dataclass(frozen=True)
class InFlight:
    """One request of a probe as the client sees it, in seconds from the probe's start."""

    sent_s: float
    """When it was sent (NaN: not yet)."""
    last_token_s: float = math.nan
    """When its latest token came (NaN: none yet)."""
    finished: bool = False
    delay_s: float = math.nan
    """Its scheduling delay, which the server reports with the last token (NaN before)."""
    waited_s: float = 0.0
    """The longest it was seen waiting unscheduled (unscheduled_waits): its delay is at least
    this."""
    gaps_over_slo: int = 0
    """Gaps between its tokens so far longer than the TBT SLO."""
    tokens_left: int = 0
    """Tokens still to come (max_tokens less those received: ignore_eos runs them all)."""


def unscheduled_waits(
    requests: Sequence[InFlight], now_s: float, num_unscheduled: int
) -> list[float]:
    """How long each request has waited unscheduled, as far as `num_unscheduled` (the
    controller's count of requests no micro-batch has held yet) shows now; 0 for the others.

    The controller starts prompts in the order they arrived (both policies admit from the head
    of their queue, and a request's first chunk goes with its admission), so the unscheduled are
    the newest of the requests sent that have no token yet. Each has waited since it was sent.
    (Requests sent within the same millisecond may reach the controller in the other order: a
    millisecond of error on a bound of seconds.)"""
    unstarted = sorted(
        (
            i
            for i, r in enumerate(requests)
            if not math.isnan(r.sent_s) and math.isnan(r.last_token_s)
        ),
        key=lambda i: requests[i].sent_s,
        reverse=True,
    )
    waits = [0.0] * len(requests)
    for i in unstarted[:num_unscheduled]:
        waits[i] = now_s - requests[i].sent_s
    return waits


def late_gaps_to_fail(total_gaps: int) -> int:
    """Gaps over the SLO that put the P99 of `total_gaps` gaps over it for sure (numpy's linear
    percentile lies at or above the sorted gap at floor(0.99 (n - 1))). Fewer gaps in the end
    (tokens that came together) need no more than this."""
    return total_gaps - math.floor(0.99 * (total_gaps - 1)) if total_gaps > 0 else 1


def certain_miss(
    requests: Sequence[InFlight],
    now_s: float,
    tbt_slo_s: float,
    total_gaps: int,
    max_median_delay_s: float = MAX_MEDIAN_DELAY_S,
) -> str:
    """Why the probe can no longer pass, or '' while it still can. total_gaps: the gaps the
    probe's requests will have, at most (max_tokens - 1 each)."""
    delayed = sum(
        1
        for r in requests
        if (r.delay_s if r.finished else r.waited_s) > max_median_delay_s  # False while NaN
    )
    if delayed >= len(requests) // 2 + 1:
        return f"median delay over {max_median_delay_s:g} s for sure"
    late = sum(r.gaps_over_slo for r in requests)
    # A gap still open past the SLO counts too, where a token is still to come.
    late += sum(
        1
        for r in requests
        if r.tokens_left > 0 and now_s - r.last_token_s > tbt_slo_s  # False while NaN
    )
    if late >= late_gaps_to_fail(total_gaps):
        return f"P99 TBT over {tbt_slo_s:.3g} s for sure"
    return ""
