"""`sarathictl tune-layout`: measure each layout `up --local` can run on this machine and keep
the fastest, which `up` then runs whenever --pp is not given.

Which layout wins depends on the CPU: on the AVX2 EPYCs one stage on both cores beat two
one-core stages in float32 (BENCHMARKS.md), and on CPUs with AVX512-BF16 or AMX nobody has
measured it yet. So rather than guess, each layout is started in turn as `up` would start it
(its threads, budgets and KV cache), given the same requests (bursts sent at once and a lone
request, bench/layout_probe.py) and stopped; the winner is written to the layout file, keyed by
this CPU, its cores, the dtype and the model (layout_file.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path

from sarathictl.argtypes import int_at_least
from sarathictl.bench.layout_probe import ProbeWorkload, probe
from sarathictl.bench.progress import say
from sarathictl.commands.up import (
    LAYOUTS,
    AutoLayout,
    default_dtype,
    resolve_model,
    threads_per_worker,
)
from sarathictl.layout_file import (
    LayoutFigures,
    MachineKey,
    MeasuredLayout,
    choose_pp,
    default_layout_file,
    machine_key,
    write_measured,
)
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig, check_layers
from stage_worker.dtype_names import DTYPE_NAMES


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "tune-layout",
        help="measure PP=1 and PP=2 on this machine; `up --local` then runs the faster",
    )
    p.add_argument("--model", default="demo", help="model folder, or `demo` (SmolLM2-135M)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *sorted(DTYPE_NAMES)],
        help="worker dtype (auto: as `up` picks it); `up` uses a measurement only at its dtype",
    )
    p.add_argument("--requests", type=int_at_least(1), default=8, help="requests per burst")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=256, help="each prompt")
    p.add_argument(
        "--output-tokens", type=int_at_least(2), default=64, help="tokens each request asks for"
    )
    p.add_argument(
        "--repeats", type=int_at_least(1), default=2, help="bursts per layout (median taken)"
    )
    p.add_argument("--kv-cache-mb", type=int_at_least(1), default=256, help="KV cache per worker")
    p.add_argument(
        "--layout-file",
        default=str(default_layout_file()),
        help="where the result is kept (default: $SARATHI_LAYOUT_FILE, else "
        "~/.cache/sarathi-cluster/layouts.json); other machines' entries stay",
    )
    p.add_argument(
        "--seed", type=int_at_least(0), default=0, help="prompts' seed (the same each layout)"
    )
    p.add_argument("--json", action="store_true", help="the measurement as JSON on stdout")
    p.set_defaults(run=run)


def layout_config(
    layout: AutoLayout, model_dir: str, dtype: str, args: argparse.Namespace
) -> LocalClusterConfig:
    """The layout as `up --local` starts it, on free ports."""
    return LocalClusterConfig(
        model_dir=model_dir,
        pp=layout.pp,
        budget_tokens=layout.budget_tokens,
        idle_budget_tokens=layout.idle_budget_tokens,
        port=0,
        dtype=dtype,
        device="cpu",
        threads_per_worker=threads_per_worker(layout.pp),
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


def measure_layout(config: LocalClusterConfig, workload: ProbeWorkload, seed: int) -> LayoutFigures:
    label = f"[PP={config.pp}]"
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
    figures = LayoutFigures(
        pp=config.pp,
        threads_per_worker=config.threads_per_worker,
        budget_tokens=config.budget_tokens,
        burst_requests_per_s=result.burst_requests_per_s,
        lone_ttft_ms=result.lone_ttft_s * 1e3,
        lone_tpot_ms=result.lone_tpot_s * 1e3,
    )
    say(f"{label} done in {time.perf_counter() - started:.0f} s")
    return figures


def table(measured: MeasuredLayout) -> str:
    rows = [
        "| layout | threads per worker | budget | burst req/s | lone TTFT ms | lone TPOT ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for f in measured.figures:
        name = f"**PP={f.pp}**" if f.pp == measured.pp else f"PP={f.pp}"
        rows.append(
            f"| {name} | {f.threads_per_worker} | {f.budget_tokens} | "
            f"{f.burst_requests_per_s:.3g} | {f.lone_ttft_ms:.0f} | {f.lone_tpot_ms:.1f} |"
        )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    dtype = default_dtype() if args.dtype == "auto" else args.dtype
    model_dir = resolve_model(args.model)
    key: MachineKey = machine_key(model_dir, dtype)
    workload = ProbeWorkload(args.requests, args.prompt_tokens, args.output_tokens, args.repeats)
    say(
        f"[tune-layout] {key.cpu}, {key.cores} cores, {dtype}, {Path(model_dir).name}: each "
        f"layout in turn, a lone request and {workload.describe()}; anything else running on "
        "this machine skews the result"
    )
    configs = [layout_config(layout, model_dir, dtype, args) for layout in LAYOUTS.values()]
    check_before_measuring(configs, workload)
    figures = tuple(measure_layout(config, workload, args.seed) for config in configs)
    measured = MeasuredLayout(
        pp=choose_pp(figures),
        measured_on=date.today().isoformat(),
        workload=workload.describe(),
        figures=figures,
    )
    path = Path(args.layout_file)
    write_measured(path, key, measured)
    if args.json:
        print(json.dumps({"machine": asdict(key), "layout": asdict(measured)}, indent=1))
    else:
        print(table(measured))
        print(
            f"\n`sarathictl up --local` runs PP={measured.pp} on this machine ({dtype}, this "
            f"model) from now on: {measured.why()}. Written to {path}."
        )
    return 0
