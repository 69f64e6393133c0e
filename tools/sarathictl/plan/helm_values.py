"""The winner of a plan as Helm values (deploy/helm/sarathi-cluster/values.yaml's keys): only
what the plan decides, so the chart's defaults and a user's own values file fill the rest
(`helm install -f plan.yaml -f mine.yaml`)."""

from __future__ import annotations

import json
from typing import Any

from sarathictl.plan.rank import PlanRow

DEFAULT_MAX_NUM_SEQS = 128
"""The controller's default cap on running sequences, the one the simulator ran with."""


def values_of(row: PlanRow, model_name: str, prefix_caching: bool = True) -> dict[str, Any]:
    pipelines = row.replicas_needed or row.replicas_max
    return {
        "pp": row.pp,
        "tp": row.tp,
        "pipelines": pipelines,
        "device": "cuda",
        "model": {"path": f"/models/{model_name}", "dtype": "bfloat16"},
        "scheduler": {
            "policy": "sarathi",
            "budgetTokens": row.budget_tokens,
            "maxNumSeqs": min(DEFAULT_MAX_NUM_SEQS, row.budget_tokens),
            "prefixCaching": prefix_caching,  # as the plan priced the workload
        },
        # Each stage on its own node, as planned: TP inside a node, PP across nodes.
        "stage": {"antiAffinity": "required" if row.pp > 1 else "preferred", "numThreads": 0},
    }


def _yaml_lines(values: dict[str, Any], indent: str = "") -> list[str]:
    """Block YAML of nested mappings of scalars (strings quoted as JSON, which YAML reads)."""
    lines = []
    for key, value in values.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines += _yaml_lines(value, indent + "  ")
        else:
            lines.append(f"{indent}{key}: {json.dumps(value)}")
    return lines


def values_yaml(row: PlanRow, model_name: str, summary: str, prefix_caching: bool = True) -> str:
    header = [
        f"# Written by `sarathictl plan`: {summary}",
        f"# Winner: {row.layout}, budget {row.budget_tokens} tokens, "
        f"{row.capacity_per_replica_qps:.3g} req/s per replica (simulated).",
        "# Set model.path (and model.volume) to where your weights are.",
    ]
    values = values_of(row, model_name, prefix_caching)
    return "\n".join([*header, *_yaml_lines(values)]) + "\n"


def deployable_winner(rows: list[PlanRow]) -> PlanRow | None:
    """The best-ranked row the chart can deploy (a stage in one pod on one node) that serves."""
    return next((r for r in rows if r.helm_deployable and r.capacity_per_replica_qps > 0), None)
