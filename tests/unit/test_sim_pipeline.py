"""The simulated pipeline: bubbles computed by hand, and whole runs through the real scheduler."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from sarathictl.bench.metrics import summarize
from sarathictl.bench.sim_run import SimSetup, prepare
from sarathictl.bench.workloads import WorkloadSpec

from controller.executor.simulated import (
    SimRequest,
    SimulatedPipeline,
    run_simulation,
)
from controller.scheduler import CacheConfig, MicroBatch, Scheduler, SchedulerConfig
from controller.simulator import StageCost


class TokensAreSeconds:
    """Every stage takes num_tokens seconds; transfers take transfer_s."""

    def __init__(self, num_stages: int, transfer_s: float = 0.0) -> None:
        self.num_stages = num_stages
        self.transfer_s = transfer_s

    def micro_batch_cost(self, batch: MicroBatch) -> StageCost:
        return StageCost([float(batch.num_tokens)] * self.num_stages, self.transfer_s)


def make_batch(batch_id: int, num_tokens: int) -> MicroBatch:
    return MicroBatch(batch_id, [], [], num_tokens)


def drive(pipeline: SimulatedPipeline, sizes: list[int], depth: int) -> None:
    """Submits micro-batches as the engine does: when stage 0 is free and fewer than depth are in
    flight (otherwise when the oldest returns)."""
    now = 0.0
    for batch_id, size in enumerate(sizes, start=1):
        now = max(now, pipeline.stage0_free_at_s)
        if pipeline.num_inflight >= depth:
            oldest = pipeline.next_completion_s
            assert oldest is not None
            now = max(now, oldest)
            pipeline.pop_completed(now)
        pipeline.submit(make_batch(batch_id, size), now)


def test_equal_micro_batches_leave_no_bubbles() -> None:
    pipeline = SimulatedPipeline(TokensAreSeconds(num_stages=4), record_intervals=True)
    drive(pipeline, [1] * 12, depth=4)
    assert pipeline.stage_intervals is not None
    for stage, intervals in enumerate(pipeline.stage_intervals):
        # Each stage works without a gap from its first micro-batch to its last.
        assert intervals[0][0] == stage
        assert all(a[1] == b[0] for a, b in itertools.pairwise(intervals))
        assert pipeline.stage_busy_s[stage] == intervals[-1][1] - intervals[0][0] == 12


def test_alternating_prefill_and_decode_bubbles_match_hand_computation() -> None:
    # Decode (1 s per stage), long prefill (3 s), decode, prefill through 2 stages, depth 2:
    #   stage 0: D1 [0,1]  P1 [1,4]  D2 [4,5]  (2 in flight until P1 returns at 7)  P2 [7,10]
    #   stage 1: D1 [1,2]  P1 [4,7]  D2 [7,8]  P2 [10,13]
    pipeline = SimulatedPipeline(TokensAreSeconds(num_stages=2), record_intervals=True)
    drive(pipeline, [1, 3, 1, 3], depth=2)
    assert pipeline.stage_intervals == [
        [(0, 1), (1, 4), (4, 5), (7, 10)],
        [(1, 2), (4, 7), (7, 8), (10, 13)],
    ]
    # 8 busy seconds per stage out of 13: bubble fraction 1 - 16/26.
    wall_s = 13.0
    bubble = 1 - sum(pipeline.stage_busy_s) / (2 * wall_s)
    assert bubble == pytest.approx(10 / 26)


def test_transfers_delay_the_next_stage() -> None:
    pipeline = SimulatedPipeline(TokensAreSeconds(num_stages=3, transfer_s=0.5))
    done_s = pipeline.submit(make_batch(1, 2), now=1.0)
    assert done_s == 1.0 + 3 * 2 + 2 * 0.5


def small_scheduler(policy: str = "sarathi", depth: int = 2) -> Scheduler:
    config = SchedulerConfig(
        policy=policy, budget_tokens=256, max_num_seqs=32, pipeline_depth=depth
    )
    return Scheduler(config, CacheConfig(num_blocks=2048))


def test_every_request_finishes_with_sane_latencies() -> None:
    requests = [SimRequest(0.01 * i, 300, 5) for i in range(40)]
    pipeline = SimulatedPipeline(TokensAreSeconds(num_stages=2))
    result = run_simulation(small_scheduler(), pipeline, requests)
    assert len(result.requests) == 40
    assert all(r.num_output_tokens == 5 for r in result.requests)
    for r in result.requests:
        assert r.arrival_s <= r.scheduled_s < r.first_token_s <= r.finish_s
    assert len(result.tbt_gaps_s) == 40 * 4  # every gap between 5 tokens
    # 40 prompts of 300 tokens under a 256-token budget: at least 12000 / 256 micro-batches.
    assert result.num_batches >= 47


def test_simulated_run_is_deterministic_for_a_seed() -> None:
    def run(seed: int) -> object:
        workload = WorkloadSpec(source="sharegpt-paper", num_requests=64, seed=seed)
        setup = SimSetup(model="mistral-7b", gpu="a100", workload=workload)
        return prepare(setup).run(qps=2.0)

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_pipeline_metrics_show_utilization_per_stage() -> None:
    workload = WorkloadSpec(source="fixed", num_requests=32, prompt_tokens=512, output_tokens=8)
    setup = SimSetup(model="llama2-70b", gpu="a40", tp=4, pp=2, link="pcie4", workload=workload)
    metrics = prepare(setup).run(qps=1.0)
    assert len(metrics.stage_utilization) == 2
    assert all(0 < u <= 1 for u in metrics.stage_utilization)
    shares = zip(metrics.stage_utilization, metrics.stage_bubble, metrics.stage_idle, strict=True)
    assert all(u + b + i == pytest.approx(1.0) for u, b, i in shares)
    util_bubble = zip(metrics.stage_utilization, metrics.stage_bubble, strict=True)
    assert metrics.bubble_fraction == pytest.approx(sum(b / (u + b) for u, b in util_bubble) / 2)
    assert 0 <= metrics.steady_bubble_fraction <= 1
    assert metrics.num_requests == 32


def test_a_pause_between_requests_is_idle_not_bubble() -> None:
    """Two requests 100 s apart: the stages are idle in between; bubble only counts the time a
    request was in the system, so it stays what one request alone gives."""
    workload = WorkloadSpec(source="fixed", num_requests=2, prompt_tokens=512, output_tokens=8)
    setup = SimSetup(model="llama2-70b", gpu="a40", tp=4, pp=2, link="pcie4", workload=workload)
    metrics = prepare(setup).run(qps=0.01)
    assert all(idle > 0.9 for idle in metrics.stage_idle)
    assert all(bubble < 0.05 for bubble in metrics.stage_bubble)
    assert metrics.bubble_fraction > 0.2  # one request alone leaves a PP=2 pipeline half empty


def test_early_stop_when_most_requests_wait_too_long() -> None:
    workload = WorkloadSpec(source="fixed", num_requests=400, prompt_tokens=2048, output_tokens=64)
    sim = prepare(SimSetup(model="mistral-7b", gpu="a100", workload=workload))
    overloaded = sim.run(qps=500.0, stop_delay_s=2.0)
    assert overloaded.stopped_early
    assert not overloaded.meets(tbt_slo_s=10.0)
    result = run_simulation(
        small_scheduler(),
        SimulatedPipeline(TokensAreSeconds(num_stages=1)),
        [SimRequest(0.0, 10, 2)],
    )
    assert summarize(result).num_requests == 1


def test_the_idle_budget_cuts_a_lone_prompts_ttft_in_simulation() -> None:
    """Prompts far apart at PP=1: with an idle budget each goes in one micro-batch rather than
    eight, so each pays a step's fixed part once; the whole-prompt baseline ignores the flag."""
    workload = WorkloadSpec(source="fixed", num_requests=4, prompt_tokens=2048, output_tokens=8)
    base = SimSetup(model="mistral-7b", gpu="a100", budget_tokens=256, workload=workload)
    chunked = prepare(base).run(qps=0.01)
    idle = prepare(replace(base, idle_budget_tokens=2048)).run(qps=0.01)
    assert idle.ttft_p50_s < chunked.ttft_p50_s
    assert idle.tbt_p99_s == pytest.approx(chunked.tbt_p99_s, rel=0.05)  # decodes alone alike
    vllm = replace(base, idle_budget_tokens=2048).with_policy("vllm")
    assert prepare(vllm).scheduler_config.idle_budget_tokens == 0
