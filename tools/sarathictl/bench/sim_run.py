"""One simulated deployment: a model on a GPU layout, a policy, a workload; run it at a rate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from controller.executor.simulated import SimulatedPipeline, run_simulation
from controller.scheduler import CacheConfig, MicroBatch, Scheduler, SchedulerConfig
from controller.simulator import (
    AnalyticCostModel,
    Deployment,
    MeasuredProfile,
    get_gpu,
    get_link,
    get_model,
)
from controller.simulator.cost_model import StageCost
from controller.simulator.linear_profile import LinearProfile, StageCoefficients
from controller.simulator.step_cost_fit import fit_step_cost
from sarathictl.bench.metrics import ServingMetrics, summarize
from sarathictl.bench.workloads import WorkloadSpec, sim_requests, unit_rate_requests

TILE_TOKENS = 32
CostModel = AnalyticCostModel | MeasuredProfile | LinearProfile
BASELINE_POLICIES = frozenset({"vllm", "orca", "request_level"})


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class SimSetup:
    model: str = "mistral-7b"
    gpu: str = "a100"
    tp: int = 1
    pp: int = 1
    link: str = "eth-100g"
    """Between pipeline stages (nodes), and between nodes of a TP group spanning several."""
    tp_link: str = "nvlink"
    nodes_per_stage: int = 1
    policy: str = "sarathi"
    budget_tokens: int = 512
    """Token budget of chunked policies; whole-prompt baselines get max_model_len (as in vLLM)
    unless baseline_budget_tokens is set."""
    baseline_budget_tokens: int = 0
    max_num_seqs: int = 128
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    orca_as_published: bool = True
    """orca as the paper ran it: KV reserved for max_model_len per request (no paging) and the
    prompts of every admitted request batched together. False: orca with paged KV."""
    profile_csv: str = ""
    """A measured profile instead of the analytic model (every stage costs what it says)."""
    stage_coefficients: StageCoefficients | None = None
    """Every stage's cost fitted to a live pipeline (controller/simulator/linear_profile.py)
    instead of the analytic model; None: unused."""
    spread_decodes: bool = True
    """With PP > 1, decodes divided among the micro-batches in flight (Scheduler)."""
    spread_prompts: bool = SchedulerConfig.spread_prompts
    """With PP > 1, prompt tokens too few for PP micro-batches shared out over them (Scheduler)."""
    prefix_caching: bool = True
    """The scheduler's prefix cache (the served default); what it saves depends on the
    workload's shared prefixes (WorkloadSpec.system_prompt_tokens)."""
    idle_budget_tokens: int = 0
    """Chunked policies at PP = 1: the budget while no sequence decodes
    (SchedulerConfig.idle_budget_tokens); 0: none. The whole-prompt baselines ignore it."""
    time_budget: float | str = 0.0
    """Chunked policies: also budget each micro-batch in predicted stage time: seconds, or
    "auto" (the time budget_tokens of a prompt's first chunk take); 0: tokens only. The
    prediction is a StepCostModel fitted to the cost model."""

    def with_policy(self, policy: str) -> SimSetup:
        return replace(self, policy=policy)


class KvPeak:
    """A cost model that also notes the scheduler's peak KV-cache usage: the cost of every
    micro-batch is asked for right after it is scheduled, when its blocks are held."""

    def __init__(self, cost_model: CostModel, scheduler: Scheduler):
        self.cost_model = cost_model
        self.num_stages = cost_model.num_stages
        self.blocks = scheduler.block_manager
        self.peak_usage = 0.0

    def micro_batch_cost(self, batch: MicroBatch) -> StageCost:
        self.peak_usage = max(self.peak_usage, self.blocks.usage)
        return self.cost_model.micro_batch_cost(batch)


@dataclass
class PreparedSim:
    """Everything a run at a given rate needs, built once per search."""

    setup: SimSetup
    deployment: Deployment
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    unit_requests: list[tuple[float, int, int]]
    cost_model: CostModel

    def run(
        self,
        qps: float,
        stop_delay_s: float | None = None,
        progress: Callable[[int], None] | None = None,
        record_intervals: bool = False,
    ) -> ServingMetrics:
        times = self.setup.workload.arrivals_at([t for t, _, _ in self.unit_requests], qps)
        requests = sim_requests(self.setup.workload, times, self.unit_requests)
        scheduler = Scheduler(
            self.scheduler_config,
            self.cache_config,
            spread_decodes=self.setup.spread_decodes,
        )
        kv = KvPeak(self.cost_model, scheduler)
        pipeline = SimulatedPipeline(kv, record_intervals=record_intervals)
        result = run_simulation(scheduler, pipeline, requests, stop_delay_s, progress)
        stats = scheduler.prefix_cache.stats
        cached = (
            stats.num_cached_tokens / stats.num_prompt_tokens if stats.num_prompt_tokens else 0.0
        )
        return replace(
            summarize(result), peak_kv_usage=kv.peak_usage, prefix_cached_token_share=cached
        )


def prepare(setup: SimSetup) -> PreparedSim:
    """Validates the layout against memory and builds scheduler config, cost model, requests."""
    unit_requests = unit_rate_requests(setup.workload)
    max_model_len = _round_up(max(p + o for _, p, o in unit_requests), TILE_TOKENS)
    if setup.policy in BASELINE_POLICIES:
        budget = setup.baseline_budget_tokens or max_model_len
    else:
        budget = setup.budget_tokens
    deployment = Deployment(
        model=get_model(setup.model),
        gpu=get_gpu(setup.gpu),
        tp=setup.tp,
        pp=setup.pp,
        stage_link=get_link(setup.link),
        tp_link=get_link(setup.tp_link),
        nodes_per_stage=setup.nodes_per_stage,
        max_batch_tokens=max(budget, max_model_len),
        min_kv_tokens=max_model_len,
    )
    cost_model: CostModel
    if setup.stage_coefficients is not None:
        cost_model = LinearProfile(setup.stage_coefficients, setup.pp)
    elif setup.profile_csv:
        transfer = AnalyticCostModel(deployment)  # the link still carries activations
        cost_model = MeasuredProfile.from_csv(
            setup.profile_csv, setup.pp, transfer.transfer_s(budget)
        )
    else:
        cost_model = AnalyticCostModel(deployment)
    max_num_seqs = setup.max_num_seqs
    if setup.policy not in BASELINE_POLICIES:
        max_num_seqs = min(max_num_seqs, budget)
    elif setup.policy == "orca" and setup.orca_as_published:
        # Orca predates PagedAttention: it reserves KV for max_model_len per request, which caps
        # its batch, and batches the prompts of every request it admits (paper, section 5.1).
        max_num_seqs = max(1, min(max_num_seqs, deployment.kv_capacity_tokens // max_model_len))
        if not setup.baseline_budget_tokens:
            budget = max_model_len * max_num_seqs
    step_cost, time_budget_s = None, 0.0
    if setup.time_budget and setup.policy not in BASELINE_POLICIES:
        step_cost = fit_step_cost(cost_model, budget, max_model_len)
        time_budget_s = (
            step_cost.fixed_s + step_cost.chunk_s(0, budget)
            if setup.time_budget == "auto"
            else float(setup.time_budget)
        )
    scheduler_config = SchedulerConfig(
        policy=setup.policy,
        budget_tokens=budget,
        idle_budget_tokens=0 if setup.policy in BASELINE_POLICIES else setup.idle_budget_tokens,
        tile_tokens=TILE_TOKENS,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        pipeline_depth=setup.pp,
        spread_prompts=setup.spread_prompts,
        time_budget_s=time_budget_s,
        step_cost=step_cost,
    )
    cache_config = CacheConfig(
        block_size=deployment.block_size,
        num_blocks=deployment.num_kv_blocks,
        prefix_caching=setup.prefix_caching,
    )
    return PreparedSim(setup, deployment, scheduler_config, cache_config, unit_requests, cost_model)
