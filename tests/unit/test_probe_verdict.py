"""When a live capacity probe may stop: only once its miss is certain (probe_verdict.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sarathictl.bench.probe_verdict import (
    InFlight,
    certain_miss,
    late_gaps_to_fail,
    unscheduled_waits,
)

NAN = math.nan


def miss(requests: list[InFlight], now_s: float, total_gaps: int = 1000) -> str:
    return certain_miss(requests, now_s, tbt_slo_s=0.3, total_gaps=total_gaps)


def test_delays_over_the_bound_for_more_than_half_settle_the_median() -> None:
    done_late = [InFlight(0.0, finished=True, delay_s=3.0) for _ in range(2)]
    done_early = [InFlight(0.0, finished=True, delay_s=0.1)]
    waited_long = InFlight(1.0, waited_s=2.5)
    requests = [*done_late, *done_early, waited_long, InFlight(7.5)]
    # Three of five sure to start later than 2 s: whatever the last one does, the median is.
    assert miss(requests, now_s=10.0) == "median delay over 2 s for sure"
    assert miss([*done_late, *done_early, InFlight(1.0, waited_s=1.5), InFlight(7.5)], 10.0) == ""
    # A finished request's own delay counts, not what it was once seen waiting.
    early_after_all = InFlight(1.0, finished=True, delay_s=0.5, waited_s=2.5)
    assert miss([*done_late, *done_early, early_after_all, InFlight(7.5)], 10.0) == ""


def test_the_unscheduled_are_the_newest_sent_without_a_token() -> None:
    requests = [
        InFlight(0.0, last_token_s=3.0),  # started
        InFlight(1.0),  # prefilling or unscheduled: no token yet
        InFlight(6.0),
        InFlight(9.0),
        InFlight(NAN),  # not sent yet
    ]
    # Two unscheduled: the two newest sent without a token, waiting since they were sent.
    assert unscheduled_waits(requests, 10.0, 2) == [0.0, 0.0, 4.0, 1.0, 0.0]
    assert unscheduled_waits(requests, 10.0, 0) == [0.0] * 5
    # More than there are candidates (a request counted before the client saw it go): all.
    assert unscheduled_waits(requests, 10.0, 9) == [0.0, 9.0, 4.0, 1.0, 0.0]


@pytest.mark.parametrize("total_gaps", [1, 2, 7, 99, 100, 101, 1234])
def test_late_gaps_to_fail_is_the_fewest_that_put_numpys_p99_over(total_gaps: int) -> None:
    slo = 1.0
    k = late_gaps_to_fail(total_gaps)
    # k gaps just over the SLO, the rest zero: the P99 is over it ...
    gaps = np.array([0.0] * (total_gaps - k) + [slo + 1e-9] * k)
    assert np.percentile(gaps, 99) > slo
    # ... while one fewer late gap can leave it within.
    fewer = np.array([0.0] * (total_gaps - k + 1) + [slo + 1e-9] * (k - 1))
    assert np.percentile(fewer, 99) <= slo


def test_late_gaps_count_open_gaps_where_a_token_is_still_to_come() -> None:
    total = 100  # two late gaps settle it
    one_late = InFlight(0.0, last_token_s=5.0, gaps_over_slo=1, tokens_left=3)
    waiting_long = InFlight(0.0, last_token_s=4.0, tokens_left=2)  # 1 s since its last token
    assert miss([one_late], now_s=5.1, total_gaps=total) == ""
    assert miss([one_late, waiting_long], now_s=5.0, total_gaps=total) == (
        "P99 TBT over 0.3 s for sure"
    )
    # Its last token came: no gap is open, however long ago.
    all_out = InFlight(0.0, last_token_s=4.0, tokens_left=0)
    assert miss([one_late, all_out], now_s=5.0, total_gaps=total) == ""
