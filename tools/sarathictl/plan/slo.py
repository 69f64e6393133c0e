"""The TBT SLO a plan is held to, in seconds: given, or the paper's strict/relaxed rule.

For the paper's four models the strict and relaxed SLOs are its Table 3 values (as `bench
paper` uses them); for any other model they are 5x and 25x the decode step of a batch of 32
(section 5) at the workload's mean context, on the reference layout: the fewest GPUs that hold
the model, with the most TP inside a node. One number for every layout, so that layouts are
compared under the same target."""

from __future__ import annotations

from controller.simulator import AnalyticCostModel
from sarathictl.bench.paper import SLOS_S
from sarathictl.plan.space import ClusterSpec, Layout, deployment_of
from sarathictl.slo_rule import SLO_BATCH, SLO_FACTORS


def reference_layout(layouts: list[Layout]) -> Layout:
    inside = [lay for lay in layouts if lay.nodes_per_stage == 1] or layouts
    return min(inside, key=lambda lay: (lay.gpus_per_replica, -lay.tp))


def resolve_slo_s(
    slo: float | str,
    cluster: ClusterSpec,
    layouts: list[Layout],
    mean_context_tokens: int,
    min_kv_tokens: int,
) -> tuple[float, str]:
    """(seconds, how it was chosen) for --tbt-slo SECONDS|strict|relaxed."""
    if not isinstance(slo, str):
        return float(slo), "given"
    if slo not in SLO_FACTORS:
        raise ValueError(f"tbt_slo must be seconds, strict or relaxed, got {slo!r}")
    if cluster.model.name in SLOS_S:
        strict, relaxed = SLOS_S[cluster.model.name]
        return (strict if slo == "strict" else relaxed), f"{slo}: the paper's Table 3"
    if not layouts:
        raise ValueError(f"--tbt-slo {slo}: no layout holds {cluster.model.name} to measure it on")
    layout = reference_layout(layouts)
    deployment = deployment_of(cluster, layout, SLO_BATCH, min_kv_tokens)
    step_s = AnalyticCostModel(deployment).decode_step_s(SLO_BATCH, mean_context_tokens)
    factor = SLO_FACTORS[slo]
    return factor * step_s, (
        f"{slo}: {factor:g}x the decode step of a batch of {SLO_BATCH} on {layout.label} "
        f"({step_s * 1e3:.1f} ms)"
    )
