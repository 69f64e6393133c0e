"""`sarathictl plan`: which layout, token budget and replica count serve a workload within a TBT
SLO on given GPUs; every candidate simulated (tools/sarathictl/plan/), a ranked table out."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from controller.simulator import GPUS, LINKS, MODELS, get_model
from controller.simulator.hardware import GPU_ALIASES, LINK_ALIASES
from sarathictl.argtypes import (
    NumberOrName,
    comma_list,
    float_above,
    float_at_least,
    float_in,
    int_at_least,
    one_of,
)
from sarathictl.bench.progress import say
from sarathictl.bench.sim_args import add_arrival_args, add_prefix_args, workload_from_args
from sarathictl.bench.workloads import WorkloadSpec, unit_rate_requests, workload_flag
from sarathictl.plan.evaluate import Candidate, Evaluation
from sarathictl.plan.helm_values import deployable_winner, values_yaml
from sarathictl.plan.rank import rank
from sarathictl.plan.report import print_table
from sarathictl.plan.search import Skipped, candidates_for, run_all
from sarathictl.plan.slo import resolve_slo_s
from sarathictl.plan.space import ClusterSpec, feasible_layouts
from sarathictl.slo_rule import SLO_FACTORS

TILE_TOKENS = 32
DEFAULT_BUDGETS = (256, 512, 1024, 2048)


def budget_tokens(text: str) -> int:
    value = int_at_least(TILE_TOKENS)(text)
    if value % TILE_TOKENS:
        raise argparse.ArgumentTypeError(f"must be a multiple of {TILE_TOKENS}, got {text!r}")
    return int(value)


budget_tokens.allowed = f"a multiple of {TILE_TOKENS}"  # type: ignore[attr-defined]
budget_tokens.bad_values = ("31", "48")  # type: ignore[attr-defined]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="pick a layout, token budget and replica count by simulation",
        description="Searches TP (inside a node, or across whole nodes), PP (across nodes), "
        "replicas and sarathi's token budget for the model, GPUs and workload; ranks them by the "
        "cluster's capacity under the TBT SLO (or by GPUs needed for --target-qps).",
    )
    c = p.add_argument_group("cluster")
    c.add_argument("--model", required=True, help=f"{', '.join(MODELS)} or a config.json path")
    gpu, link = one_of("GPU", GPUS, GPU_ALIASES), one_of("link", LINKS, LINK_ALIASES)
    c.add_argument("--gpu", type=gpu, required=True, help=", ".join(gpu.names))
    c.add_argument("--num-gpus", type=int_at_least(1), required=True, help="GPUs in all")
    c.add_argument("--gpus-per-node", type=int_at_least(1), default=8, help="default 8")
    c.add_argument("--link", type=link, default="eth-100g", help="between nodes")
    c.add_argument("--tp-link", type=link, default="nvlink", help="between a node's GPUs")
    s = p.add_argument_group("target")
    s.add_argument(
        "--tbt-slo",
        type=NumberOrName(float_above(0.0), tuple(SLO_FACTORS)),
        required=True,
        help="P99 TBT in seconds, or strict/relaxed (the paper's Table 3 for its models; "
        "otherwise 5x/25x the simulated decode step of a batch of 32)",
    )
    s.add_argument(
        "--target-qps",
        type=float_at_least(0.0),
        default=0.0,
        help="requests/s the cluster must serve: rank by GPUs needed (default 0: by capacity)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--trace", type=workload_flag(), default="arxiv", help="as in bench simulate")
    w.add_argument("--num-requests", type=int_at_least(1), default=1024, help="per simulation")
    w.add_argument("--seed", type=int_at_least(0), default=0)
    w.add_argument("--max-total-tokens", type=int_at_least(0), default=0, help="length filter")
    add_arrival_args(w, WorkloadSpec())
    add_prefix_args(w, WorkloadSpec())
    g = p.add_argument_group("search")
    g.add_argument(
        "--budgets",
        type=comma_list(budget_tokens),
        default=DEFAULT_BUDGETS,
        help="token budgets to try (default 256,512,1024,2048)",
    )
    g.add_argument("--max-num-seqs", type=int_at_least(1), default=128)
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="price the workload with the prefix cache off, and write prefixCaching: false to "
        "--values (default: on, as served)",
    )
    g.add_argument(
        "--granularity",
        type=float_in(0.0, 1.0, lo_open=True, hi_open=True),
        default=0.05,
        help="relative precision of each capacity (default 0.05)",
    )
    g.add_argument(
        "--jobs", type=int_at_least(1), default=os.cpu_count() or 1, help="worker processes"
    )
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int_at_least(0), default=15, help="rows shown (0: all)")
    o.add_argument("--json", action="store_true", help="one JSON document on stdout")
    o.add_argument("--values", type=Path, default=None, help="write the winner's Helm values here")
    p.set_defaults(run=run)


def _progress(started: float) -> Callable[[Evaluation, int, int], None]:
    def on_done(e: Evaluation, done: int, total: int) -> None:
        c = e.candidate
        say(
            f"[plan {done}/{total}] {c.layout.label} budget {c.budget_tokens}: "
            f"{e.capacity_qps:.3g} req/s per replica ({e.num_probes} probes, {e.wall_s:.1f} s; "
            f"{time.perf_counter() - started:.0f} s so far)"
        )

    return on_done


def _model_len(spec: WorkloadSpec) -> tuple[int, int]:
    """(longest request rounded up to the tile: the KV a replica must hold, mean context)."""
    rows = unit_rate_requests(spec)
    longest = max(p + o for _, p, o in rows)
    mean_context = sum(p + o / 2 for _, p, o in rows) / len(rows)
    return -(-longest // TILE_TOKENS) * TILE_TOKENS, int(mean_context)


def plan(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """The search behind the command: every row ranked, what was skipped, the SLO used."""
    cluster = ClusterSpec(
        get_model(args.model), args.gpu, args.num_gpus, args.gpus_per_node, args.link, args.tp_link
    )
    spec = workload_from_args(args)
    max_model_len, mean_context = _model_len(spec)
    layouts, rejected = feasible_layouts(cluster, min(args.budgets), max_model_len)
    slo_s, slo_why = resolve_slo_s(args.tbt_slo, cluster, layouts, mean_context, max_model_len)
    say(
        f"[plan] {cluster.model.name} on {cluster.num_gpus} {cluster.gpu} ({cluster.num_nodes} "
        f"nodes of {cluster.gpus_per_node}, {cluster.link}): {len(layouts)} layouts hold it; "
        f"P99 TBT <= {slo_s:.3g} s ({slo_why}); {spec.num_requests} {spec.source} requests each"
    )
    if not layouts:
        reasons = "; ".join(f"{lay.label}: {why}" for lay, why in rejected)
        raise ValueError(f"no layout of {cluster.num_gpus} {cluster.gpu} holds it: {reasons}")
    base = Candidate(
        model=args.model,
        gpu=args.gpu,
        link=args.link,
        tp_link=args.tp_link,
        layout=layouts[0],
        budget_tokens=args.budgets[0],
        workload=spec,
        tbt_slo_s=slo_s,
        granularity=args.granularity,
        max_num_seqs=args.max_num_seqs,
        target_qps=args.target_qps,
        prefix_caching=not args.no_prefix_caching,
    )
    candidates, skipped = candidates_for(base, cluster, layouts, args.budgets, max_model_len)
    skipped = [Skipped(lay, 0, why) for lay, why in rejected] + skipped
    say(f"[plan] simulating {len(candidates)} candidates on {args.jobs} worker(s)")
    evaluations = run_all(candidates, args.jobs, _progress(started))
    rows = rank(evaluations, cluster, args.target_qps)
    return {
        "cluster": cluster,
        "spec": spec,
        "slo_s": slo_s,
        "slo_why": slo_why,
        "rows": rows,
        "skipped": skipped,
    }


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    result = plan(args, started)
    rows, cluster = result["rows"], result["cluster"]
    wall_s = time.perf_counter() - started
    target = f", target {args.target_qps:g} req/s" if args.target_qps else ""
    summary = (
        f"{cluster.model.name} on {cluster.num_gpus} {cluster.gpu} ({cluster.gpus_per_node} per "
        f"node, {cluster.link}), {result['spec'].source}, P99 TBT <= {result['slo_s']:.3g} s"
        f"{target}"
    )
    winner = deployable_winner(rows)
    if args.values is not None:
        if winner is None:
            say("[plan] no deployable layout serves the workload: no values written")
        else:
            caching = not args.no_prefix_caching
            args.values.write_text(values_yaml(winner, cluster.model.name, summary, caching))
            say(f"[plan] wrote the Helm values of {winner.layout} to {args.values}")
    say(f"[plan] done in {wall_s:.1f} s")
    if args.json:
        document = {
            "summary": summary,
            "tbt_slo_s": result["slo_s"],
            "tbt_slo_rule": result["slo_why"],
            "target_qps": args.target_qps,
            "rows": [r.as_dict() for r in rows],
            "winner": winner.as_dict() if winner else None,
            "skipped": [{**asdict(s), "layout": s.layout.label} for s in result["skipped"]],
            "wall_s": wall_s,
        }
        print(json.dumps(document, indent=2))
    else:
        print_table(rows, result["skipped"], summary, args.target_qps, args.top)
    return 0 if rows and rows[0].capacity_per_replica_qps > 0 else 1
