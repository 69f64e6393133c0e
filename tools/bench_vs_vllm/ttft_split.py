"""Each request's TTFT by what it met on arrival: an empty system (alone) or other requests
in flight (beside them).

The two engines pay for a prompt differently. Alone, both prefill it at once (ours with the
idle budget); beside decoding requests, ours splits it into budget-sized chunks so that the
decodes keep their pace, and pays each chunk's step, while vLLM prefills it whole and holds
the decodes back (their TBT). The median over all requests mixes the two cases in whatever
share the Poisson arrivals gave; split, each is compared like for like.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TtftSplit:
    alone_ms: float
    """Median TTFT of the requests that arrived with no other request in the system; NaN: none."""
    num_alone: int
    beside_ms: float
    """Median TTFT of those that arrived while others were in it; NaN: none."""
    num_beside: int


def _median_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds) if seconds else math.nan


def split_ttft(
    start_s: Sequence[float],
    latency_s: Sequence[float],
    ttft_s: Sequence[float],
    ok: Sequence[bool],
) -> TtftSplit:
    """Request i (sent at start_s[i], done latency_s[i] later) met others when some other
    request's span [start, start + latency) holds its start, failed ones included (they were
    in the system too). Only completed requests (ok) have a TTFT to count."""
    spans = list(zip(start_s, latency_s, strict=True))
    alone: list[float] = []
    beside: list[float] = []
    for i, (start, _) in enumerate(spans):
        if not ok[i]:
            continue
        met = any(j != i and s <= start < s + lat for j, (s, lat) in enumerate(spans))
        (beside if met else alone).append(ttft_s[i])
    return TtftSplit(_median_ms(alone), len(alone), _median_ms(beside), len(beside))


def ttft_split_of(result: dict[str, object]) -> TtftSplit | None:
    """The split of a `vllm bench serve --save-detailed` result; None without per-request
    lists (a result saved without --save-detailed)."""
    lists: list[list[float]] = []
    for key in ("start_times", "latencies", "ttfts"):
        values = result.get(key)
        if not isinstance(values, list):
            return None
        lists.append([float(v) for v in values])
    start_s, latency_s, ttft_s = lists
    if not len(start_s) == len(latency_s) == len(ttft_s):
        return None
    errors = result.get("errors")
    failed = errors if isinstance(errors, list) and len(errors) == len(start_s) else []
    ok = [not (failed and failed[i]) and ttft_s[i] > 0 for i in range(len(start_s))]
    return split_ttft(start_s, latency_s, ttft_s, ok)
