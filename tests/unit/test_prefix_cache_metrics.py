"""The prefix cache's hit rate (tokens and requests), cached blocks and evictions, as status and
Prometheus report them after requests that share a prefix."""

from __future__ import annotations

import re

from controller.metrics import ControllerMetrics
from controller.scheduler import RequestParams, Scheduler
from controller.server import prefix_cache_status
from tests.unit.scheduler.factories import FakePipeline, create_scheduler

SYSTEM = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16


def serve(sched: Scheduler, prompts: list[list[int]]) -> None:
    for prompt in prompts:  # one after another: each finds what the previous ones left
        seq_id = sched.prefix_cache.stats.num_requests + 1
        sched.add_request(seq_id, prompt, RequestParams(max_tokens=2), 0.0)
        FakePipeline(sched).run_to_completion()


def metric(metrics: ControllerMetrics, name: str) -> float:
    text = metrics.exposition()[0].decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_status_and_prometheus_count_hits_in_tokens_and_requests() -> None:
    sched = create_scheduler(budget_tokens=64, num_blocks=8, max_model_len=128)
    # 8 blocks: the last prompt's 3 find 1 unnamed free block and evict 2 cached ones.
    serve(sched, [[*SYSTEM, 1], [*SYSTEM, 2, 3], [7] * 90, [*SYSTEM, 4], [8] * 40])
    status = prefix_cache_status(sched)
    assert status.enabled
    assert (status.num_requests, status.num_hit_requests) == (5, 2)
    assert (status.num_prompt_tokens, status.num_cached_tokens) == (41 + 42 + 90 + 41 + 40, 64)
    assert (status.num_evictions, status.num_cached_blocks) == (2, 2 + 5 - 2 + 2)
    metrics = ControllerMetrics()
    metrics.on_scheduler_state(sched)
    metrics.on_scheduler_state(sched)  # running totals: counted once
    assert metric(metrics, "sarathi:prefix_cache_queries_total") == status.num_prompt_tokens
    assert metric(metrics, "sarathi:prefix_cache_hits_total") == 64
    assert metric(metrics, "sarathi:prefix_cache_query_requests_total") == 5
    assert metric(metrics, "sarathi:prefix_cache_hit_requests_total") == 2
    assert metric(metrics, "sarathi:prefix_cache_blocks") == status.num_cached_blocks
    assert metric(metrics, "sarathi:prefix_cache_evictions_total") == status.num_evictions


def test_with_the_cache_off_status_says_so_and_counts_nothing() -> None:
    sched = create_scheduler(budget_tokens=64, prefix_caching=False)
    serve(sched, [[*SYSTEM, 1], [*SYSTEM, 2]])
    status = prefix_cache_status(sched)
    assert not status.enabled and status.num_requests == 0 and status.num_cached_blocks == 0


def test_the_cache_configuration_is_exported_for_the_endpoint_picker() -> None:
    sched = create_scheduler(num_blocks=321, block_size=16)
    metrics = ControllerMetrics()
    metrics.on_scheduler_state(sched)
    metrics.on_scheduler_state(sched)
    text = metrics.exposition()[0].decode()
    (line,) = [x for x in text.splitlines() if x.startswith("sarathi:cache_config_info{")]
    # vLLM's label names: the endpoint picker reads block_size and num_gpu_blocks.
    assert 'block_size="16"' in line and 'num_gpu_blocks="321"' in line and line.endswith(" 1.0")
