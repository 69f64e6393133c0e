"""Prometheus metrics, named after vLLM's where the meaning is the same so dashboards carry over.

Served on the OpenAI HTTP port's `/metrics` (where vLLM serves them, and where an inference
gateway's endpoint picker scrapes a model server) and, optionally, on a port of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from controller.bind_error import BindError
from controller.scheduler import Scheduler
from controller.telemetry import StageShares

INFERENCE_GATEWAY_METRICS = {
    "TotalQueuedRequests": "sarathi:num_requests_waiting",
    "TotalRunningRequests": "sarathi:num_requests_running",
    "KVCacheUtilization": "sarathi:kv_cache_usage_perc",
    "CacheInfo": "sarathi:cache_config_info",
}
"""The Gateway API Inference Extension's model server protocol: each metric it scrapes (all
gauges) and our name for it; the endpoint picker is told these names by flag (see the chart).
CacheInfo carries the KV-cache block size and block count in its labels (vLLM's)."""

# Seconds; from 1 ms decodes on GPUs to multi-second queues under overload.
_LATENCY_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


class ControllerMetrics:
    """One registry per controller (no global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # /metrics lists the families in the order they are registered here.
        self._add_latency_metrics()
        self._add_scheduler_metrics()
        self._add_prefix_cache_metrics()
        self._add_token_and_request_metrics()
        self._add_stage_metrics()
        # The scheduler and the workers report running totals; the counters take the increase.
        self._preemptions_seen = 0
        self._prefix_seen = [0] * 5  # the prefix cache's totals already counted (_on_prefix_cache)
        self._busy_s_seen: dict[int, float] = {}

    def _add_latency_metrics(self) -> None:
        """Per-request latency histograms: time to first token, between tokens, in the queue."""
        r = self.registry
        self.ttft = Histogram(
            "sarathi:time_to_first_token_seconds",
            "Request arrival to first token.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "sarathi:inter_token_latency_seconds",
            "Gap between consecutive tokens of a request (every gap is a sample).",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_time = Histogram(
            "sarathi:request_queue_time_seconds",
            "Request arrival to its first scheduled micro-batch.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )

    def _add_scheduler_metrics(self) -> None:
        """The scheduler's state (the gauges an inference gateway scrapes) and its preemptions."""
        r = self.registry
        self.running = Gauge(
            "sarathi:num_requests_running", "Requests holding KV blocks.", registry=r
        )
        self.waiting = Gauge("sarathi:num_requests_waiting", "Requests queued.", registry=r)
        self.kv_usage = Gauge(
            "sarathi:kv_cache_usage_perc", "Share of KV-cache blocks in use (0..1).", registry=r
        )
        self.preemptions = Counter(
            "sarathi:num_preemptions", "Sequences preempted for recompute.", registry=r
        )

    def _add_prefix_cache_metrics(self) -> None:
        """Automatic prefix caching: its hit rate in tokens (hits over queries, vLLM's names)
        and in requests, the blocks it holds and its evictions."""
        r = self.registry
        self.prefix_queries = Counter(
            "sarathi:prefix_cache_queries",
            "Tokens of sequences admitted with the prefix cache on.",
            registry=r,
        )
        self.prefix_hits = Counter(
            "sarathi:prefix_cache_hits",
            "Of those tokens, the ones taken from the prefix cache instead of computed.",
            registry=r,
        )
        self.prefix_query_requests = Counter(
            "sarathi:prefix_cache_query_requests",
            "Sequences admitted with the prefix cache on.",
            registry=r,
        )
        self.prefix_hit_requests = Counter(
            "sarathi:prefix_cache_hit_requests",
            "Of those sequences, the ones that started past a cached prefix.",
            registry=r,
        )
        self.prefix_blocks = Gauge(
            "sarathi:prefix_cache_blocks", "KV blocks holding a cached prefix.", registry=r
        )
        self.prefix_evictions = Counter(
            "sarathi:prefix_cache_evictions",
            "Cached KV blocks that lost their prefix to make room.",
            registry=r,
        )
        # vLLM's cache_config_info labels: the inference gateway's endpoint picker sizes its
        # estimate of each server's prefix cache from them (--cache-info-metric).
        self.cache_config = Gauge(
            INFERENCE_GATEWAY_METRICS["CacheInfo"],
            "KV-cache configuration in its labels (value 1).",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=r,
        )
        self._cache_config_seen: tuple[str, str, str] | None = None

    def _add_token_and_request_metrics(self) -> None:
        """Tokens in and out, and finished requests by why they finished."""
        r = self.registry
        self.prompt_tokens = Counter(
            "sarathi:prompt_tokens", "Prompt tokens of requests that got a first token.", registry=r
        )
        self.generation_tokens = Counter(
            "sarathi:generation_tokens", "Output tokens sent to clients.", registry=r
        )
        self.success = Counter(
            "sarathi:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )

    def _add_stage_metrics(self) -> None:
        """How each pipeline stage spends its time (utilization, bubble, idle), and the
        pipeline's bubble: the ratios over the last 30 s, the busy seconds as a running total."""
        r = self.registry
        window = "over the last 30 s"
        self.stage_utilization = Gauge(
            "sarathi:stage_utilization_ratio",
            f"Stage busy time over wall time, {window}.",
            ["stage"],
            registry=r,
        )
        self.stage_bubble = Gauge(
            "sarathi:stage_bubble_ratio",
            f"Share of wall time the stage idled while the pipeline had work, {window}.",
            ["stage"],
            registry=r,
        )
        self.stage_idle = Gauge(
            "sarathi:stage_idle_ratio",
            f"Share of wall time with no work at all, {window}.",
            ["stage"],
            registry=r,
        )
        self.stage_busy_seconds = Counter(
            "sarathi:stage_busy_seconds",
            "Seconds the stage has computed (rate() of it is the stage's utilization).",
            ["stage"],
            registry=r,
        )
        self.bubble = Gauge(
            "sarathi:pipeline_bubble_fraction",
            f"Bubble over busy plus bubble time, mean over stages, {window}.",
            registry=r,
        )

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise BindError(
                f"cannot bind /metrics to {host}:{port}: {err.strerror or err}"
            ) from err

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition and its content type, for an HTTP server of our own."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc()

    def on_token_gap(self, gap_s: float) -> None:
        self.itl.observe(gap_s)
        self.generation_tokens.inc()

    def on_finished(self, reason: str, queue_s: float) -> None:
        self.success.labels(finished_reason=reason).inc()
        self.queue_time.observe(queue_s)

    def on_scheduler_state(self, sched: Scheduler) -> None:
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.kv_usage.set(sched.kv_usage)
        if sched.num_preemptions > self._preemptions_seen:
            self.preemptions.inc(sched.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = sched.num_preemptions
        self._on_prefix_cache(sched)

    def _on_prefix_cache(self, sched: Scheduler) -> None:
        stats = sched.prefix_cache.stats
        bm = sched.block_manager
        totals = (
            (self.prefix_queries, stats.num_prompt_tokens),
            (self.prefix_hits, stats.num_cached_tokens),
            (self.prefix_query_requests, stats.num_requests),
            (self.prefix_hit_requests, stats.num_hit_requests),
            (self.prefix_evictions, bm.num_evictions),
        )
        seen = self._prefix_seen
        for i, (counter, total) in enumerate(totals):
            if total > seen[i]:
                counter.inc(total - seen[i])
                seen[i] = total
        self.prefix_blocks.set(bm.num_cached_blocks)
        config = (str(bm.block_size), str(bm.num_blocks), str(sched.prefix_cache.enabled))
        if config != self._cache_config_seen:  # once: the cache keeps its size across rebuilds
            if self._cache_config_seen is not None:
                self.cache_config.remove(*self._cache_config_seen)
            self.cache_config.labels(*config).set(1)
            self._cache_config_seen = config

    def on_stages(self, shares: Sequence[StageShares], busy_s_totals: Sequence[float]) -> None:
        for stage, (share, busy_s_total) in enumerate(zip(shares, busy_s_totals, strict=True)):
            label = str(stage)
            self.stage_utilization.labels(stage=label).set(share.utilization)
            self.stage_bubble.labels(stage=label).set(share.bubble)
            self.stage_idle.labels(stage=label).set(share.idle)
            # A rebuilt stage's workers count from zero again: all of their total is new then.
            seen = self._busy_s_seen.get(stage, 0.0)
            new_s = busy_s_total - seen if busy_s_total >= seen else busy_s_total
            busy = self.stage_busy_seconds.labels(stage=label)  # exported from 0 on
            if new_s > 0:
                busy.inc(new_s)
            self._busy_s_seen[stage] = busy_s_total
        if shares:
            self.bubble.set(sum(s.bubble_fraction for s in shares) / len(shares))
