"""Prometheus metrics, named after vLLM's where the meaning is the same so dashboards carry over."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from controller.scheduler import Scheduler

# Seconds; from 1 ms decodes on GPUs to multi-second queues under overload.
_LATENCY_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


class ControllerMetrics:
    """One registry per controller (no global state), served on its own port."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
        self.success = Counter(
            "sarathi:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.stage_busy = Gauge(
            "sarathi:stage_busy_ratio", "Stage busy time over wall time.", ["stage"], registry=r
        )
        self.bubble = Gauge(
            "sarathi:pipeline_bubble_fraction",
            "1 minus the mean stage busy ratio.",
            registry=r,
        )
        self._preemptions_seen = 0

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_token_gap(self, gap_s: float) -> None:
        self.itl.observe(gap_s)

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

    def on_stage_utilization(self, busy_ratios: list[float]) -> None:
        for stage, ratio in enumerate(busy_ratios):
            self.stage_busy.labels(stage=str(stage)).set(ratio)
        if busy_ratios:
            self.bubble.set(1.0 - sum(busy_ratios) / len(busy_ratios))
