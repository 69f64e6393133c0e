"""Command-line flags shared by `bench simulate` and `bench capacity`, mapped onto SimSetup."""

from __future__ import annotations

import argparse

from controller.budget_flags import SPREAD_PROMPTS_HELP
from controller.simulator import GPUS, LINKS, MODELS
from controller.simulator.hardware import GPU_ALIASES, LINK_ALIASES
from sarathictl.argtypes import (
    NumberOrName,
    comma_list,
    float_above,
    float_in,
    int_at_least,
    one_of,
)
from sarathictl.bench.arrivals import ARRIVALS, DIURNAL_RATES
from sarathictl.bench.sim_run import SimSetup
from sarathictl.bench.workloads import (
    PAPER_DATASETS,
    SYNTHETIC,
    TRACE_FILES,
    WorkloadSpec,
    default_arrival,
    workload_flag,
)


def add_arrival_args(group: argparse._ArgumentGroup, defaults: WorkloadSpec) -> None:
    """--arrival, --burstiness, --rate-curve, --rate-period-s (simulate, capacity, plan, run)."""
    group.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default=None,
        help="poisson, gamma (bursty: --burstiness) or replay (the trace's own arrival times, "
        "time-scaled to the rate asked for); default: replay for a trace that records arrival "
        "times (splitwise, or a file with an arrived_at/arrival_s/timestamp column), else poisson",
    )
    group.add_argument(
        "--burstiness",
        type=float_above(0.0),
        default=defaults.burstiness,
        help="gamma arrivals: squared coefficient of variation of the gaps (1: Poisson)",
    )
    group.add_argument(
        "--rate-curve",
        type=comma_list(NumberOrName(float_above(0.0), ("diurnal",)), allow_empty=True),
        default=(),
        help="relative arrival rates over equal slices of --rate-period-s, repeating (e.g. "
        "0.5,1,2,1), or `diurnal` (24 hourly rates, 3:1 peak to trough); default: flat",
    )
    group.add_argument(
        "--rate-period-s",
        type=float_above(0.0),
        default=defaults.rate_period_s,
        help="period of --rate-curve in seconds (default: a day compressed into an hour)",
    )


def add_prefix_args(group: argparse._ArgumentGroup, defaults: WorkloadSpec) -> None:
    """--system-prompt-tokens, --system-prompts: the prefixes requests share (simulate,
    capacity, plan)."""
    group.add_argument(
        "--system-prompt-tokens",
        type=int_at_least(0),
        default=defaults.system_prompt_tokens,
        help="a system prompt of this many tokens in front of every prompt, shared by the "
        "requests that draw the same one (the prefix cache computes it once); default 0: none",
    )
    group.add_argument(
        "--system-prompts",
        type=int_at_least(1),
        default=defaults.num_system_prompts,
        help="distinct system prompts, drawn round robin (default 1)",
    )


def rate_curve_from_args(values: tuple[float | str, ...]) -> tuple[float, ...]:
    if "diurnal" in values:
        if len(values) > 1:
            raise ValueError("--rate-curve: `diurnal` stands alone, not in a list of rates")
        return DIURNAL_RATES
    return tuple(float(v) for v in values)


def workload_from_args(args: argparse.Namespace, **lengths: int) -> WorkloadSpec:
    """The workload flags of add_arrival_args plus --trace, --num-requests, --seed."""
    return WorkloadSpec(
        source=args.trace,
        num_requests=args.num_requests,
        seed=args.seed,
        max_total_tokens=getattr(args, "max_total_tokens", 0),
        arrival=args.arrival or default_arrival(args.trace),
        burstiness=args.burstiness,
        rate_curve=rate_curve_from_args(args.rate_curve),
        rate_period_s=args.rate_period_s,
        system_prompt_tokens=getattr(args, "system_prompt_tokens", 0),
        num_system_prompts=getattr(args, "system_prompts", 1),
        **lengths,
    )


def add_setup_args(parser: argparse.ArgumentParser) -> None:
    """The flags of a simulated run (setup_from_args reads them), in three help groups:
    deployment, scheduler and workload; then --json."""
    _add_deployment_args(parser.add_argument_group("deployment"))
    _add_scheduler_args(parser.add_argument_group("scheduler"))
    _add_workload_args(parser.add_argument_group("workload"))
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")


def _add_deployment_args(group: argparse._ArgumentGroup) -> None:
    """The model and the hardware it runs on: GPU, TP x PP layout, links, or a measured
    profile."""
    d = SimSetup()
    gpu = one_of("GPU", GPUS, GPU_ALIASES)
    link = one_of("link", LINKS, LINK_ALIASES)
    positive = int_at_least(1)
    group.add_argument(
        "--model", default=d.model, help=f"{', '.join(MODELS)} or a config.json path"
    )
    group.add_argument("--gpu", type=gpu, default=d.gpu, help=", ".join(gpu.names))
    group.add_argument("--tp", type=positive, default=d.tp, help="tensor-parallel GPUs per stage")
    group.add_argument("--pp", type=positive, default=d.pp, help="pipeline stages")
    group.add_argument(
        "--link", type=link, default=d.link, help=f"between stages/nodes: {', '.join(link.names)}"
    )
    group.add_argument("--tp-link", type=link, default=d.tp_link, help="between the GPUs of a node")
    group.add_argument(
        "--nodes-per-stage",
        type=positive,
        default=d.nodes_per_stage,
        help="nodes one TP group spans",
    )
    group.add_argument("--profile", default="", help="measured stage-time CSV instead of the model")


def _add_scheduler_args(group: argparse._ArgumentGroup) -> None:
    """How micro-batches are filled: token and time budgets, sequence cap, and the PP > 1
    spreading and orca variants."""
    d = SimSetup()
    positive = int_at_least(1)
    group.add_argument(
        "--budget", type=positive, default=d.budget_tokens, help="token budget (sarathi)"
    )
    group.add_argument(
        "--baseline-budget",
        type=int_at_least(0),
        default=0,
        help="token budget of vllm/orca (0, the default: the longest request, as in vLLM)",
    )
    group.add_argument("--max-num-seqs", type=positive, default=d.max_num_seqs)
    group.add_argument(
        "--idle-budget",
        type=int_at_least(0),
        default=d.idle_budget_tokens,
        help="sarathi at PP=1: token budget while no sequence decodes (a multiple of 32, at "
        "least --budget; 0, the default: --budget always)",
    )
    group.add_argument(
        "--time-budget",
        type=NumberOrName(float_in(0.0, 3600.0), ("auto",)),
        default=0.0,
        help="sarathi: also fill each micro-batch only up to this predicted stage time, seconds "
        "(auto: what --budget tokens of a prompt's first chunk take); default: tokens only",
    )
    group.add_argument(
        "--spread-decodes",
        action=argparse.BooleanOptionalAction,
        default=d.spread_decodes,
        help="with PP > 1, divide the decodes among the micro-batches in flight (--no-: every "
        "ready decode joins the next micro-batch, as before issue 15)",
    )
    group.add_argument(
        "--spread-prompts",
        action=argparse.BooleanOptionalAction,
        default=d.spread_prompts,
        help=f"{SPREAD_PROMPTS_HELP} (default on, as served; --no-: each micro-batch takes "
        "what its budget allows)",
    )
    group.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="the scheduler without its prefix cache (default: on, as served)",
    )
    group.add_argument(
        "--orca-paged",
        action="store_true",
        help="orca with a paged KV cache (default: as the paper ran it, KV reserved per request)",
    )


def _add_workload_args(group: argparse._ArgumentGroup) -> None:
    """The requests: source (trace, paper dataset or synthetic), count, seed, length filter,
    arrivals, and the lengths of synthetic sources."""
    w = WorkloadSpec()
    positive = int_at_least(1)
    sources = ", ".join([*TRACE_FILES, *PAPER_DATASETS, *SYNTHETIC])
    group.add_argument(
        "--trace",
        type=workload_flag(),
        default=w.source,
        help=f"{sources}, or a CSV or JSONL file (lengths, optionally arrival times)",
    )
    group.add_argument("--num-requests", type=positive, default=w.num_requests)
    group.add_argument("--seed", type=int_at_least(0), default=w.seed)
    group.add_argument(
        "--max-total-tokens", type=int_at_least(0), default=0, help="length filter (0: none)"
    )
    add_arrival_args(group, w)
    add_prefix_args(group, w)
    group.add_argument(
        "--prompt-tokens", type=positive, default=w.prompt_tokens, help="synthetic sources"
    )
    group.add_argument(
        "--output-tokens", type=positive, default=w.output_tokens, help="synthetic sources"
    )


def setup_from_args(args: argparse.Namespace, policy: str) -> SimSetup:
    workload = workload_from_args(
        args, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens
    )
    return SimSetup(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        pp=args.pp,
        link=args.link,
        tp_link=args.tp_link,
        nodes_per_stage=args.nodes_per_stage,
        policy=policy,
        budget_tokens=args.budget,
        baseline_budget_tokens=args.baseline_budget,
        max_num_seqs=args.max_num_seqs,
        idle_budget_tokens=args.idle_budget,
        spread_decodes=args.spread_decodes,
        spread_prompts=args.spread_prompts,
        time_budget=args.time_budget,
        orca_as_published=not args.orca_paged,
        prefix_caching=not args.no_prefix_caching,
        workload=workload,
        profile_csv=args.profile,
    )
