"""One candidate of a plan: a layout and a token budget, simulated as one replica.

Its capacity is the project's (bench/capacity.py): the highest mean arrival rate with P99 TBT
within the SLO and median scheduling delay within 2 s, by bisection. The metrics reported beside
it are those of the operating point: the highest rate that passed, or, for a target rate, that
rate shared over the replicas it needs."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from sarathictl.bench.capacity import MAX_MEDIAN_DELAY_S, ProbeResult, search_capacity
from sarathictl.bench.capacity_cmd import first_guess_qps
from sarathictl.bench.metrics import ServingMetrics
from sarathictl.bench.sim_run import SimSetup, prepare
from sarathictl.bench.workloads import WorkloadSpec
from sarathictl.plan.space import Layout


@dataclass(frozen=True)
class Candidate:
    """Everything a worker process needs to evaluate one (layout, budget): plain, picklable."""

    model: str
    """A preset name or a config.json path."""
    gpu: str
    link: str
    tp_link: str
    layout: Layout
    budget_tokens: int
    workload: WorkloadSpec
    tbt_slo_s: float
    granularity: float
    max_num_seqs: int = 128
    target_qps: float = 0.0
    """Rate the whole cluster must serve (0: none); shared over the replicas needed."""
    prefix_caching: bool = True
    """Price the workload with the controller's prefix cache on, as served by default."""

    def setup(self) -> SimSetup:
        return SimSetup(
            model=self.model,
            gpu=self.gpu,
            tp=self.layout.tp,
            pp=self.layout.pp,
            link=self.link,
            tp_link=self.tp_link,
            nodes_per_stage=self.layout.nodes_per_stage,
            policy="sarathi",
            budget_tokens=self.budget_tokens,
            max_num_seqs=self.max_num_seqs,
            prefix_caching=self.prefix_caching,
            workload=self.workload,
        )


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    capacity_qps: float
    """Per replica."""
    operating_qps: float
    """Per replica: the rate the metrics below were measured at (NaN: nothing passed)."""
    at_operating: ServingMetrics | None
    kv_capacity_tokens: int
    num_probes: int
    wall_s: float

    @property
    def replicas_needed(self) -> int:
        """Replicas for the target rate (0 without one or without capacity)."""
        target = self.candidate.target_qps
        if not target or not self.capacity_qps > 0:
            return 0
        return math.ceil(target / self.capacity_qps - 1e-9)


def evaluate(candidate: Candidate) -> Evaluation:
    started = time.perf_counter()
    sim = prepare(candidate.setup())
    passing: dict[float, ServingMetrics] = {}

    def passes(qps: float) -> ProbeResult:
        metrics = sim.run(qps, stop_delay_s=MAX_MEDIAN_DELAY_S)
        ok = metrics.meets(candidate.tbt_slo_s, MAX_MEDIAN_DELAY_S)
        if ok:
            passing[qps] = metrics
        return ProbeResult(qps, ok, metrics.tbt_p99_s, metrics.scheduling_delay_p50_s)

    result = search_capacity(passes, first_guess_qps(sim), candidate.granularity)
    capacity = result.capacity_qps
    operating, metrics = capacity, passing.get(capacity)
    probes = len(result.probes)
    if candidate.target_qps and capacity > 0:
        replicas = math.ceil(candidate.target_qps / capacity - 1e-9)
        operating = candidate.target_qps / replicas
        metrics = sim.run(operating)
        probes += 1
    return Evaluation(
        candidate,
        capacity,
        operating if metrics is not None else math.nan,
        metrics,
        sim.deployment.kv_capacity_tokens,
        probes,
        time.perf_counter() - started,
    )
