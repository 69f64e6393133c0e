"""What `bench prefix-routing` reports of one policy's run: the turns its sessions held, and the
controllers' prefix-cache counters before and after it. Pure."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PREFIX_COUNTERS = (
    "sarathi:prefix_cache_queries_total",
    "sarathi:prefix_cache_hits_total",
    "sarathi:prefix_cache_query_requests_total",
    "sarathi:prefix_cache_hit_requests_total",
    "sarathi:prefix_cache_evictions_total",
)


@dataclass
class Turn:
    session: int
    turn: int
    endpoint: str
    ttft_s: float
    prompt_chars: int


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests_admitted: int = 0
    requests_hit: int = 0
    evicted_blocks: int = 0
    """Cached blocks the pipelines evicted for room during the run (a cache too small)."""
    later_turns: int = 0
    later_turns_same_pipeline: int = 0
    ttft_median_s: float = float("nan")
    ttft_p90_s: float = float("nan")
    wall_s: float = 0.0
    requests_per_pipeline: list[int] = field(default_factory=list)

    @property
    def token_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.requests_hit / self.requests_admitted if self.requests_admitted else 0.0

    @property
    def stickiness(self) -> float:
        """Share of later turns sent to the pipeline of the conversation's previous turn."""
        return self.later_turns_same_pipeline / self.later_turns if self.later_turns else 0.0

    def line(self) -> str:
        per_pipeline = "/".join(map(str, self.requests_per_pipeline))
        return (
            f"{self.policy:<14} hit tokens {self.token_hit_rate:6.1%}  hit requests "
            f"{self.request_hit_rate:6.1%}  same pipeline {self.stickiness:6.1%}  TTFT median "
            f"{self.ttft_median_s * 1e3:6.0f} ms p90 {self.ttft_p90_s * 1e3:6.0f} ms  "
            f"per pipeline {per_pipeline}  evicted {self.evicted_blocks} blocks  "
            f"{self.wall_s:.0f} s" + (f"  ERRORS {self.errors}" if self.errors else "")
        )


def summarize(
    policy: str, turns: list[Turn], errors: int, endpoints: list[str],
    before: list[dict[str, float]], after: list[dict[str, float]], wall_s: float,
) -> PolicyResult:  # fmt: skip
    """One policy's result: the turns its sessions held and how many failed, and each
    endpoint's PREFIX_COUNTERS before and after its run."""
    delta = {n: sum(a[n] - b[n] for a, b in zip(after, before, strict=True)) for n in before[0]}
    queries, hits, query_requests, hit_requests, evictions = (delta[n] for n in PREFIX_COUNTERS)
    previous: dict[int, str] = {}
    later = same = 0
    for turn in sorted(turns, key=lambda t: (t.session, t.turn)):
        if turn.session in previous:
            later += 1
            same += previous[turn.session] == turn.endpoint
        previous[turn.session] = turn.endpoint
    ttfts = sorted(t.ttft_s for t in turns)
    return PolicyResult(
        policy=policy,
        requests=len(turns),
        errors=errors,
        prompt_tokens=int(queries),
        cached_tokens=int(hits),
        requests_admitted=int(query_requests),
        requests_hit=int(hit_requests),
        evicted_blocks=int(evictions),
        later_turns=later,
        later_turns_same_pipeline=same,
        ttft_median_s=statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p90_s=ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan"),
        wall_s=wall_s,
        requests_per_pipeline=[sum(t.endpoint == e for t in turns) for e in endpoints],
    )
