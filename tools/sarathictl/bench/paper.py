"""`sarathictl bench paper`: the Sarathi-Serve paper's capacity study, reproduced in simulation.

Four deployments (Table 1 of arXiv 2403.02310), strict and relaxed P99 TBT SLOs (Table 3) with
token budgets 512 / 2048 (LLaMA2-70B relaxed: 1536), policies sarathi, vllm and orca, two
workloads; plus the Table 4 ablation and Falcon-180B TP8 across nodes versus TP4-PP2. Capacity
searches are independent, so they run in a process pool (local worker processes; nothing leaves
the machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from controller.scheduler import MicroBatch, ScheduledChunk
from sarathictl.argtypes import comma_list, int_at_least
from sarathictl.bench.capacity_cmd import first_guess_qps, measure_capacity
from sarathictl.bench.paper_report import hardware_summary, write_section
from sarathictl.bench.progress import rate, say
from sarathictl.bench.sim_run import SimSetup, prepare
from sarathictl.bench.workloads import WorkloadSpec, workload_flag

POLICIES = ("sarathi", "vllm", "orca")
# The paper's Table 3 (seconds): strict, relaxed P99 TBT.
SLOS_S = {
    "mistral-7b": (0.1, 0.5),
    "yi-34b": (0.2, 1.0),
    "llama2-70b": (1.0, 5.0),
    "falcon-180b": (1.0, 5.0),
}


@dataclass(frozen=True)
class PaperDeployment:
    label: str
    setup: SimSetup
    relaxed_budget_tokens: int = 2048


# The paper's hardware: Azure NC96ads A100 v4 (4 A100s per VM, NVLink between pairs only, so a
# TP4 ring crosses PCIe; 100 Gbps Ethernet between VMs), and one server of 8 pairwise-bridged A40s.
# 256 sequences at most: vLLM's default max_num_seqs, which the paper's vLLM-based engine inherits.
MAX_NUM_SEQS = 256
DEPLOYMENTS = (
    PaperDeployment(
        "Mistral-7B, 1 A100", SimSetup("mistral-7b", "a100", 1, 1, max_num_seqs=MAX_NUM_SEQS)
    ),
    PaperDeployment(
        "Yi-34B, TP2 A100",
        SimSetup("yi-34b", "a100", 2, 1, tp_link="nvlink", max_num_seqs=MAX_NUM_SEQS),
    ),
    PaperDeployment(
        "LLaMA2-70B, TP4-PP2 A40",
        SimSetup(
            "llama2-70b", "a40", 4, 2, link="pcie4", tp_link="pcie4", max_num_seqs=MAX_NUM_SEQS
        ),
        relaxed_budget_tokens=1536,
    ),
    PaperDeployment(
        "Falcon-180B, TP4-PP2 A100, 100GbE",
        SimSetup(
            "falcon-180b", "a100", 4, 2, link="eth-100g", tp_link="pcie4", max_num_seqs=MAX_NUM_SEQS
        ),
    ),
)
WORKLOADS = ("sharegpt-paper", "arxiv")


@dataclass(frozen=True)
class CapacityJob:
    group: str
    """main or tp8."""
    label: str
    slo: str
    """strict or relaxed."""
    tbt_slo_s: float
    setup: SimSetup


def capacity_jobs(num_requests: int, seed: int, workloads: tuple[str, ...]) -> list[CapacityJob]:
    jobs = []
    for dep in DEPLOYMENTS:
        strict_s, relaxed_s = SLOS_S[dep.setup.model]
        for workload in workloads:
            spec = WorkloadSpec(source=workload, num_requests=num_requests, seed=seed)
            for slo, slo_s, budget in (
                ("strict", strict_s, 512),
                ("relaxed", relaxed_s, dep.relaxed_budget_tokens),
            ):
                for policy in POLICIES:
                    setup = replace(dep.setup, policy=policy, budget_tokens=budget, workload=spec)
                    jobs.append(CapacityJob("main", dep.label, slo, slo_s, setup))
    # TP8 over two 4-GPU nodes (all-reduces on Ethernet) versus TP4-PP2 (one transfer per step).
    falcon = DEPLOYMENTS[3].setup
    spec = WorkloadSpec(source="arxiv", num_requests=num_requests, seed=seed)
    tp8 = replace(falcon, tp=8, pp=1, nodes_per_stage=2)
    for label, base in (("TP4-PP2", falcon), ("TP8 across 2 nodes", tp8)):
        for slo, slo_s, budget in (("strict", 1.0, 512), ("relaxed", 5.0, 2048)):
            for policy in ("sarathi", "vllm"):
                setup = replace(base, policy=policy, budget_tokens=budget, workload=spec)
                jobs.append(CapacityJob("tp8", label, slo, slo_s, setup))
    return jobs


def run_capacity_job(job: CapacityJob) -> dict[str, object]:
    started = time.perf_counter()
    result = measure_capacity(job.setup, job.tbt_slo_s)
    return {
        "group": job.group,
        "label": job.label,
        "slo": job.slo,
        "tbt_slo_s": job.tbt_slo_s,
        "policy": job.setup.policy,
        "model": job.setup.model,
        "workload": job.setup.workload.source,
        "budget_tokens": job.setup.budget_tokens,
        "capacity_qps": result.capacity_qps,
        "num_probes": len(result.probes),
        "wall_s": time.perf_counter() - started,
    }


def run_ablation(seed: int, workloads: tuple[str, ...]) -> list[dict[str, object]]:
    """Table 4: Yi-34B TP2, budget 1024, 128 requests, at half the first-guess rate of the
    deployment (a moderate load; the paper does not state its rate)."""
    rows = []
    base = replace(
        DEPLOYMENTS[1].setup,
        budget_tokens=1024,
        baseline_budget_tokens=1024,
        orca_as_published=False,
    )
    for workload in workloads:
        spec = WorkloadSpec(source=workload, num_requests=128, seed=seed)
        qps = first_guess_qps(prepare(replace(base, workload=spec)))
        for name, policy in (
            ("hybrid-batching-only", "orca"),
            ("chunked-prefills-only", "chunked_only"),
            ("Sarathi-Serve (combined)", "sarathi"),
        ):
            metrics = prepare(replace(base, policy=policy, workload=spec)).run(qps)
            rows.append(
                {
                    "scheduler": name,
                    "workload": workload,
                    "qps": qps,
                    "ttft_p50_s": metrics.ttft_p50_s,
                    "tbt_p99_s": metrics.tbt_p99_s,
                }
            )
    return rows


def run_budget_sweep(
    capacity: list[dict[str, object]], num_requests: int, seed: int, workloads: tuple[str, ...]
) -> list[dict[str, object]]:
    """Falcon-180B TP4-PP2 at sarathi's strict-SLO capacity with budgets 512, 1024 and 2048:
    how the budget trades P99 TBT against pipeline bubbles (why the paper gave LLaMA2-70B 1536)."""
    workload = "sharegpt-paper" if "sharegpt-paper" in workloads else workloads[0]
    falcon = DEPLOYMENTS[3]
    rates = [
        float(str(r["capacity_qps"]))
        for r in capacity
        if r["group"] == "main"
        and r["label"] == falcon.label
        and r["workload"] == workload
        and r["slo"] == "strict"
        and r["policy"] == "sarathi"
    ]
    if not rates or rates[0] <= 0:
        return []
    spec = WorkloadSpec(source=workload, num_requests=num_requests, seed=seed)
    rows: list[dict[str, object]] = []
    for budget in (512, 1024, 2048):
        setup = replace(falcon.setup, budget_tokens=budget, workload=spec)
        m = prepare(setup).run(rates[0])
        rows.append(
            {
                "label": falcon.label,
                "workload": workload,
                "qps": rates[0],
                "budget_tokens": budget,
                "tbt_p99_s": m.tbt_p99_s,
                "scheduling_delay_p50_s": m.scheduling_delay_p50_s,
                "bubble_fraction": m.bubble_fraction,
                "throughput_rps": m.throughput_rps,
            }
        )
    return rows


def median_prefills(
    num_requests: int, seed: int, workloads: tuple[str, ...]
) -> list[dict[str, object]]:
    """What one whole prompt of median length costs end to end (all stages): the stall a
    whole-prompt policy puts into every running decode's TBT."""
    rows: list[dict[str, object]] = []
    for dep in DEPLOYMENTS:
        for workload in workloads:
            spec = WorkloadSpec(source=workload, num_requests=num_requests, seed=seed)
            sim = prepare(replace(dep.setup, workload=spec))
            prompts = sorted(p for _, p, _ in sim.unit_requests)
            median = prompts[len(prompts) // 2]
            chunk = ScheduledChunk(0, 0, median, True, (), [], None)
            cost = sim.cost_model.micro_batch_cost(MicroBatch(0, [chunk], [], median))
            total_s = sum(cost.stage_times_s) + (len(cost.stage_times_s) - 1) * cost.transfer_s
            rows.append(
                {
                    "label": dep.label,
                    "workload": workload,
                    "median_prompt_tokens": median,
                    "prefill_s": total_s,
                    "strict_slo_s": SLOS_S[dep.setup.model][0],
                }
            )
    return rows


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "paper",
        help="the paper's capacity study in simulation; writes BENCHMARKS.md's section",
    )
    parser.add_argument(
        "--num-requests", type=int_at_least(1), default=1024, help="requests per run"
    )
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument(
        "--workloads",
        type=comma_list(workload_flag()),
        default=WORKLOADS,
        help=f"comma-separated (default: {','.join(WORKLOADS)})",
    )
    parser.add_argument(
        "--jobs", type=int_at_least(1), default=2, help="parallel capacity searches"
    )
    parser.add_argument("--output", default="BENCHMARKS.md", help="markdown file to update")
    parser.add_argument("--json-output", default="", help="also write the raw results here")
    parser.add_argument("--json", action="store_true", help="raw results on stdout")
    parser.add_argument(
        "--from-json", default="", help="re-render the section from saved results; run nothing"
    )
    parser.set_defaults(run=run)


def job_line(row: dict[str, object]) -> str:
    """`falcon-180b sarathi strict arxiv: capacity 1.1 req/s, 9 probes (34 s)`."""
    where = f" {row['label']}" if row["group"] != "main" else ""
    capacity = float(str(row["capacity_qps"]))
    wall_s = float(str(row["wall_s"]))
    return (
        f"{row['model']}{where} {row['policy']} {row['slo']} {row['workload']}: capacity "
        f"{rate(capacity)}, {row['num_probes']} probes ({wall_s:.0f} s)"
    )


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        write_section(Path(args.output), json.loads(Path(args.from_json).read_text()))
        print(f"re-rendered the bench-paper section of {args.output} from {args.from_json}")
        return 0
    workloads: tuple[str, ...] = args.workloads
    jobs = capacity_jobs(args.num_requests, args.seed, workloads)
    started = time.perf_counter()
    say(
        f"bench paper: {len(jobs)} capacity searches of {args.num_requests} requests "
        f"({', '.join(workloads)}) on {args.jobs} processes"
    )
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_capacity_job, job) for job in jobs]
        for done, future in enumerate(as_completed(futures), start=1):
            say(f"[{done}/{len(jobs)}] {job_line(future.result())}")
        results = [future.result() for future in futures]  # in job order, for a stable table
    say(f"ablation (Table 4): 3 schedulers x {len(workloads)} workloads")
    ablation = run_ablation(args.seed, workloads)
    say("budget sweep: Falcon-180B at sarathi's strict capacity, budgets 512, 1024, 2048")
    budget_sweep = run_budget_sweep(results, args.num_requests, args.seed, workloads)
    say("median prefill costs")
    prefills = median_prefills(args.num_requests, args.seed, workloads)
    wall_s = time.perf_counter() - started
    report = {
        "command": (
            f"sarathictl bench paper --num-requests {args.num_requests} --seed {args.seed} "
            f"--workloads {','.join(workloads)} --jobs {args.jobs}"
        ),
        "date": datetime.date.today().isoformat(),
        "hardware": hardware_summary(),
        "num_requests": args.num_requests,
        "seed": args.seed,
        "workloads": list(workloads),
        "capacity": results,
        "ablation": ablation,
        "budget_sweep": budget_sweep,
        "median_prefills": prefills,
        "wall_s": wall_s,
        "deployments": [asdict(d) for d in DEPLOYMENTS],
    }
    if args.json_output:
        Path(args.json_output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_output).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    write_section(Path(args.output), report)
    if not args.json:
        print(f"wrote the bench-paper section of {args.output} ({wall_s:.0f} s)")
    return 0
