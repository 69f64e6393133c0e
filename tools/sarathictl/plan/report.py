"""The plan as a ranked text table (stdout), or one JSON document."""

from __future__ import annotations

import math

from sarathictl.plan.rank import PlanRow
from sarathictl.plan.search import Skipped


def _num(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


HEADER = (
    f"{'#':>2} {'layout':<18} {'budget':>6} {'GPUs':>4} {'repl':>4} {'req/s/repl':>10} "
    f"{'req/s/GPU':>9} {'cluster':>8} {'P99 TBT':>8} {'TTFT p50':>8} {'bubble':>6} "
    f"{'KV tokens':>10} {'KV free':>7}"
)


def table_line(r: PlanRow, with_target: bool) -> str:
    replicas = f"{r.replicas_needed}" if with_target else f"{r.replicas_max}"
    flags = "" if r.helm_deployable else "  (not deployable by the chart: a stage spans nodes)"
    if with_target and not r.fits_target:
        flags += f"  (needs {r.gpus_needed or 'more'} GPUs)"
    return (
        f"{r.rank:>2} {r.layout:<18} {r.budget_tokens:>6} {r.gpus_per_replica:>4} {replicas:>4} "
        f"{r.capacity_per_replica_qps:>10.3f} {r.capacity_per_gpu_qps:>9.4f} "
        f"{r.cluster_capacity_qps:>8.3f} {_num(r.tbt_p99_s, '.3f'):>8} "
        f"{_num(r.ttft_p50_s, '.2f'):>8} {_pct(r.bubble_fraction):>6} "
        f"{r.kv_capacity_tokens:>10,} {_pct(r.kv_headroom):>7}{flags}"
    )


def print_table(
    rows: list[PlanRow], skipped: list[Skipped], title: str, target_qps: float, limit: int
) -> None:
    print(title)
    print(HEADER)
    for r in rows[:limit] if limit else rows:
        print(table_line(r, bool(target_qps)))
    if limit and len(rows) > limit:
        print(f"   ... {len(rows) - limit} more (--top 0 shows all)")
    what = "replicas needed for the target" if target_qps else "replicas the GPUs hold"
    print(
        f"repl: {what}; req/s: capacity (P99 TBT within the SLO, median scheduling delay within "
        "2 s); cluster: repl x req/s/repl; P99 TBT, TTFT, bubble and KV free at "
        + ("the target's rate per replica" if target_qps else "capacity")
    )
    if skipped:
        print(f"skipped ({len(skipped)}):")
        for s in skipped:
            what = s.layout.label + (f" budget {s.budget_tokens}" if s.budget_tokens else "")
            print(f"  {what}: {s.reason}")
