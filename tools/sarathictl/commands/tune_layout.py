"""`sarathictl tune-layout`: measure each layout `up --local` can run on this machine and keep
the fastest, which `up` then runs whenever --pp is not given (with --dtype auto, in its dtype).

Which layout wins depends on the CPU: on the AVX2 EPYCs one stage on both cores beat two
one-core stages in float32 (BENCHMARKS.md), and on CPUs with AVX512-BF16 or AMX nobody has
measured it yet, nor whether bf16 through oneDNN beats float32 through our AVX2 kernels there.
So rather than guess, each layout (a depth and, for `--dtype auto`, each dtype auto may run) is
started as `up` would start it (its threads, budgets and KV cache), given the same requests (a
lone request and a burst sent at once, bench/layout_probe.py) and stopped. The layouts take
turns over the rounds, forwards then backwards (ABBA ABBA): with an even number of rounds a
drift of the shared machine's speed that is steady over the minutes falls on every layout
alike, and the medians set one-off outliers aside. Each layout's medians decide; the winner is
written to the layout file, keyed by this CPU, its cores, the dtype asked for and the model
(layout_file.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import grpc

from sarathictl.argtypes import int_at_least
from sarathictl.bench.layout_probe import ProbeResult, ProbeWorkload, probe
from sarathictl.bench.progress import say
from sarathictl.commands.up import resolve_model
from sarathictl.layout_choice import (
    LAYOUTS,
    AutoLayout,
    auto_dtypes,
    fitted_layout,
    threads_per_worker,
)
from sarathictl.layout_file import (
    LayoutFigures,
    MachineKey,
    MeasuredLayout,
    choose,
    default_layout_file,
    layout_name,
    machine_key,
    write_measured,
)
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig, check_layers
from stage_worker.dtype_names import DTYPE_NAMES


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "tune-layout",
        help="measure PP=1 and PP=2 (and bf16 against float32 where the CPU has both) on this "
        "machine; `up --local` then runs the fastest",
    )
    p.add_argument("--model", default="demo", help="model folder, or `demo` (SmolLM2-135M)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *sorted(DTYPE_NAMES)],
        help="worker dtype (auto: each dtype `up --dtype auto` may run here: bf16 and float32 "
        "where the CPU computes bf16 natively and our float32 kernels load, else one); `up "
        "--dtype NAME` uses NAME's layouts of an auto measurement",
    )
    p.add_argument("--requests", type=int_at_least(1), default=8, help="requests in the burst")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=256, help="each prompt")
    p.add_argument(
        "--output-tokens", type=int_at_least(2), default=64, help="tokens each request asks for"
    )
    p.add_argument(
        "--rounds",
        type=int_at_least(1),
        default=4,
        help="times each layout is started and measured, the layouts taking turns forwards "
        "then backwards (medians kept; an even number balances a steady drift)",
    )
    p.add_argument("--kv-cache-mb", type=int_at_least(1), default=256, help="KV cache per worker")
    p.add_argument(
        "--layout-file",
        default=str(default_layout_file()),
        help="where the result is kept (default: $SARATHI_LAYOUT_FILE, else "
        "~/.cache/sarathi-cluster/layouts.json); other machines' entries stay",
    )
    p.add_argument(
        "--seed",
        type=int_at_least(0),
        default=0,
        help="prompts' seed (each round draws new prompts, the same for every layout)",
    )
    p.add_argument("--json", action="store_true", help="the measurement as JSON on stdout")
    p.set_defaults(run=run)


@dataclass(frozen=True)
class Candidate:
    layout: AutoLayout
    dtype: str

    @property
    def name(self) -> str:
        return layout_name(self.layout.pp, self.dtype)


def layout_config(
    candidate: Candidate, model_dir: str, args: argparse.Namespace
) -> LocalClusterConfig:
    """The layout as `up --local` starts it, on free ports."""
    return LocalClusterConfig(
        model_dir=model_dir,
        pp=candidate.layout.pp,
        budget_tokens=candidate.layout.budget_tokens,
        idle_budget_tokens=candidate.layout.idle_budget_tokens,
        port=0,
        dtype=candidate.dtype,
        device="cpu",
        threads_per_worker=threads_per_worker(candidate.layout.pp),
        kv_cache_bytes=args.kv_cache_mb << 20,
    )


def check_before_measuring(configs: list[LocalClusterConfig], workload: ProbeWorkload) -> None:
    """ValueError for what would fail only after the first layout's measurement: a depth the
    model cannot take, requests longer than its context."""
    for config in configs:
        check_layers(config)
    model_config = json.loads((Path(configs[0].model_dir) / "config.json").read_text())
    context = model_config.get("max_position_embeddings")
    tokens = workload.prompt_tokens + workload.output_tokens
    if isinstance(context, int) and tokens > context:
        raise ValueError(
            f"--prompt-tokens plus --output-tokens is {tokens}, beyond the model's context of "
            f"{context} tokens"
        )


def turns(count: int, rounds: int) -> list[tuple[int, int]]:
    """(round, candidate index) in the order measured: forwards in even rounds, backwards in
    odd ones (ABBA...), so that drift in the machine's speed falls on every candidate alike."""
    order: list[tuple[int, int]] = []
    for r in range(rounds):
        indices = range(count) if r % 2 == 0 else reversed(range(count))
        order.extend((r, i) for i in indices)
    return order


def measure_once(
    candidate: Candidate,
    config: LocalClusterConfig,
    workload: ProbeWorkload,
    seed: int,
    round_label: str,
) -> ProbeResult:
    label = f"[{candidate.name}, {round_label}]"
    say(
        f"{label} starting: {config.threads_per_worker} thread(s) per worker, budget "
        f"{config.budget_tokens}"
        + (f", idle budget {config.idle_budget_tokens}" if config.idle_budget_tokens else "")
    )
    started = time.perf_counter()
    with LocalCluster(config) as cluster:
        say(f"{label} serving after {time.perf_counter() - started:.1f} s; measuring")
        result = asyncio.run(
            probe(cluster.addr, workload, seed, lambda line: say(f"{label} {line}"))
        )
    say(f"{label} done in {time.perf_counter() - started:.0f} s")
    return result


def medians(
    candidate: Candidate,
    config: LocalClusterConfig,
    workload: ProbeWorkload,
    runs: list[ProbeResult],
) -> LayoutFigures:
    return LayoutFigures(
        pp=candidate.layout.pp,
        dtype=candidate.dtype,
        threads_per_worker=config.threads_per_worker,
        budget_tokens=config.budget_tokens,
        burst_requests_per_s=statistics.median(r.burst_requests_per_s for r in runs),
        lone_ttft_ms=statistics.median(r.lone_ttft_s for r in runs) * 1e3,
        lone_tpot_ms=statistics.median(r.lone_tpot_s for r in runs) * 1e3,
        prompt_tokens=workload.prompt_tokens,
        idle_budget_tokens=config.idle_budget_tokens,
    )


@dataclass
class Measured:
    """What measure_all got: each layout's medians, and the layouts that failed."""

    figures: tuple[LayoutFigures, ...]
    failed: dict[str, str]
    """Layout name -> why it was left out (its cluster died or never served)."""


def measure_all(
    candidates: list[Candidate],
    model_dir: str,
    workload: ProbeWorkload,
    args: argparse.Namespace,
) -> Measured:
    """Every candidate once a round, in turns. One whose cluster dies or never serves (a
    kernel that fails on this CPU, memory) is left out, saying why, and the others measured:
    on a CPU no one has measured, one broken layout should not cost the verdict."""
    configs = [layout_config(c, model_dir, args) for c in candidates]
    check_before_measuring(configs, workload)
    runs: list[list[ProbeResult]] = [[] for _ in candidates]
    failed: dict[str, str] = {}
    for r, i in turns(len(candidates), args.rounds):
        if candidates[i].name in failed:
            continue
        round_label = f"round {r + 1} of {args.rounds}"
        # The round's seed: every candidate gets the same prompts within a round.
        try:
            runs[i].append(
                measure_once(candidates[i], configs[i], workload, args.seed + r, round_label)
            )
        except (RuntimeError, TimeoutError, grpc.RpcError) as err:
            # Its first line and, for a child that died, the last line of its log.
            lines = str(err).strip().splitlines() or [type(err).__name__]
            failed[candidates[i].name] = " ... ".join(dict.fromkeys((lines[0], lines[-1])))
            say(f"[{candidates[i].name}, {round_label}] failed, left out: {err}")
    if len(failed) == len(candidates):
        raise RuntimeError(
            "every layout failed: " + "; ".join(f"{name}: {why}" for name, why in failed.items())
        )
    figures = tuple(
        medians(c, config, workload, rs)
        for c, config, rs in zip(candidates, configs, runs, strict=True)
        if c.name not in failed
    )
    return Measured(figures, failed)


def table(measured: MeasuredLayout) -> str:
    rows = [
        "| layout | threads per worker | budget | burst req/s | lone TTFT ms | lone TPOT ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for f in measured.figures:
        name = f"**{f.name}**" if f == measured.winner() else f.name
        rows.append(
            f"| {name} | {f.threads_per_worker} | {f.budget_tokens} | "
            f"{f.burst_requests_per_s:.3g} | {f.lone_ttft_ms:.0f} | {f.lone_tpot_ms:.1f} |"
        )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    dtypes = auto_dtypes() if args.dtype == "auto" else (args.dtype,)
    model_dir = resolve_model(args.model)
    key: MachineKey = machine_key(model_dir, args.dtype)
    workload = ProbeWorkload(args.requests, args.prompt_tokens, args.output_tokens)
    described = f"{args.rounds} round{'' if args.rounds == 1 else 's'} of {workload.describe()}"
    candidates = [Candidate(layout, dtype) for dtype in dtypes for layout in LAYOUTS.values()]
    say(
        f"[tune-layout] {key.cpu}, {key.cores} cores, {Path(model_dir).name}: "
        f"{', '.join(c.name for c in candidates)}; {described}, the layouts in turn. Anything "
        "else running on this machine skews the result"
    )
    try:
        got = measure_all(candidates, model_dir, workload, args)
    except RuntimeError as err:
        print(f"sarathictl: {err}", file=sys.stderr)
        return 1
    won = choose(got.figures)
    measured = MeasuredLayout(
        pp=won.pp,
        dtype=won.dtype,
        measured_on=date.today().isoformat(),
        workload=described,
        figures=got.figures,
    )
    path = Path(args.layout_file)
    dtype_flag = "" if args.dtype == "auto" else f" --dtype {args.dtype}"
    write_measured(path, key, measured)
    if args.json:
        document = {"machine": asdict(key), "layout": asdict(measured), "failed": got.failed}
        print(json.dumps(document, indent=1))
    else:
        print(table(measured))
        for name, why in got.failed.items():
            print(f"{name}: left out, it failed ({why})")
        print(
            f"\n`sarathictl up --local{dtype_flag}` runs {won.name} on this machine (this "
            f"model) from now on: {measured.why()}. Written to {path}."
        )
        for pp in (1, 2):
            at = measured.best_at(pp)
            if at is None:
                continue
            why = fitted_layout(at, measured.one_stage(at.dtype)).why_budget
            if why:
                print(f"At PP={pp} ({at.dtype}), {why}.")
    return 0
