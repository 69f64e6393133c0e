"""Ranking a plan's candidates and the figures a user reads off them.

Without a target rate the cluster's capacity decides: replicas the GPUs hold times the capacity
of one, higher first. With one, the GPUs needed decide: replicas needed times GPUs per replica,
fewer first, among the candidates whose GPUs suffice; then capacity per GPU. Ties: lower P99 TBT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sarathictl.plan.evaluate import Evaluation
from sarathictl.plan.space import ClusterSpec


@dataclass(frozen=True)
class PlanRow:
    rank: int
    layout: str
    tp: int
    pp: int
    nodes_per_stage: int
    budget_tokens: int
    gpus_per_replica: int
    replicas_max: int
    """Replicas the cluster's GPUs hold."""
    capacity_per_replica_qps: float
    capacity_per_gpu_qps: float
    cluster_capacity_qps: float
    """replicas_max times one replica's capacity."""
    replicas_needed: int
    """For the target rate (0: no target, or no capacity)."""
    gpus_needed: int
    fits_target: bool
    operating_qps: float
    """Per replica: the rate the latency figures are from."""
    tbt_p99_s: float
    ttft_p50_s: float
    bubble_fraction: float
    kv_capacity_tokens: int
    kv_headroom: float
    """Share of the KV cache never used at the operating point (1 - peak usage)."""
    helm_deployable: bool

    def as_dict(self) -> dict[str, object]:
        return {
            k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in vars(self).items()
        }


def row_of(evaluation: Evaluation, cluster: ClusterSpec) -> PlanRow:
    c, layout = evaluation.candidate, evaluation.candidate.layout
    replicas_max = layout.replicas_on(cluster)
    capacity = evaluation.capacity_qps
    needed = evaluation.replicas_needed
    m = evaluation.at_operating
    nan = math.nan
    return PlanRow(
        rank=0,
        layout=layout.label,
        tp=layout.tp,
        pp=layout.pp,
        nodes_per_stage=layout.nodes_per_stage,
        budget_tokens=c.budget_tokens,
        gpus_per_replica=layout.gpus_per_replica,
        replicas_max=replicas_max,
        capacity_per_replica_qps=capacity,
        capacity_per_gpu_qps=capacity / layout.gpus_per_replica,
        cluster_capacity_qps=capacity * replicas_max,
        replicas_needed=needed,
        gpus_needed=needed * layout.gpus_per_replica,
        fits_target=bool(c.target_qps) and 0 < needed <= replicas_max,
        operating_qps=evaluation.operating_qps,
        tbt_p99_s=m.tbt_p99_s if m else nan,
        ttft_p50_s=m.ttft_p50_s if m else nan,
        bubble_fraction=m.bubble_fraction if m else nan,
        kv_capacity_tokens=evaluation.kv_capacity_tokens,
        kv_headroom=1.0 - m.peak_kv_usage if m else nan,
        helm_deployable=layout.helm_deployable,
    )


def _tbt(row: PlanRow) -> float:
    return row.tbt_p99_s if not math.isnan(row.tbt_p99_s) else math.inf


def rank(evaluations: list[Evaluation], cluster: ClusterSpec, target_qps: float) -> list[PlanRow]:
    rows = [row_of(e, cluster) for e in evaluations]
    if target_qps:
        rows.sort(
            key=lambda r: (
                not r.fits_target,
                r.gpus_needed if r.replicas_needed else math.inf,
                -r.capacity_per_gpu_qps,
                _tbt(r),
            )
        )
    else:
        rows.sort(key=lambda r: (-r.cluster_capacity_qps, -r.capacity_per_gpu_qps, _tbt(r)))
    return [PlanRow(**{**vars(r), "rank": i}) for i, r in enumerate(rows, start=1)]
