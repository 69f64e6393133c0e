"""`python -m bench_vs_vllm`: vLLM and sarathi-cluster side by side on this machine, each driven
by `vllm bench serve` at every rate of a list, one server at a time (see __init__.py).

Run by the vLLM venv's Python with tools/ and the repository on the path (the bubbles take
the controller's formula: bubbles.py); `make bench-vs-vllm` does both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import sys
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from types import FrameType

from bench_vs_vllm.bubble_causes import all_causes_tables
from bench_vs_vllm.bubbles import request_spans, run_bubbles, stage_steps
from bench_vs_vllm.client import (
    BenchError,
    Workload,
    bench_command,
    prefix_workload,
    random_workload,
    rate_flag,
    run_bench,
    trace_workload,
)
from bench_vs_vllm.dataset import MultiTurn, write_multi_turn_dataset, write_trace_dataset
from bench_vs_vllm.pipeline_bound import all_bound_tables
from bench_vs_vllm.plot import plot
from bench_vs_vllm.results import (
    MAX_MEDIAN_TTFT_S,
    Row,
    bubble_table,
    capacity,
    capacity_table,
    load_row,
    markdown_table,
    slo_from_light_load,
    stages_path,
    ttft_split_table,
)
from bench_vs_vllm.servers import ServerError, ServerSpec, sarathi_spec, serving, vllm_spec
from bench_vs_vllm.targets import strict_slo_ms, targets_table, verdicts, verdicts_of_summary

TOOLS = Path(__file__).resolve().parent.parent
REPO = TOOLS.parent
TRACE = TOOLS / "sarathictl" / "bench" / "traces" / "splitwise_conv.csv"
SYSTEMS = ("vllm", "vllm-pp2", "sarathi", "sarathi-pp1", "sarathi-pp2")
"""vLLM's single process and its pipeline (PP=2, a core a stage); ours with up's default layout
(which depends on the machine: `up` says which), as one stage with every core, and as two
stages with a share of the cores each."""
WORKLOADS = ("random", "conversation", "prefix", "multiturn")
DTYPES = ("auto", "bfloat16", "float32")
WARM_UP_SEED_OFFSET = 10_000
"""The warm-up's prompts come from a seed no measured run uses: none of them is cached."""


def client_env(seed: int) -> dict[str, str]:
    """The client's environment. The target device: without it vLLM's CPU wheel guesses its
    platform and, on a CPU without AVX-512, dies of an illegal instruction before it sends a
    request. The hash seed: the timed_trace dataset draws a chunk's tokens from Python's hash()
    of its id, so it follows the run's seed (both systems get the same prompts, each rate new
    ones)."""
    return {"VLLM_TARGET_DEVICE": "cpu", "PYTHONHASHSEED": str(seed)}


def run_seed(args: argparse.Namespace, rate: float) -> int:
    """Each rate its own prompts: with the prefix caches on, prompts repeated from the rate
    before would all be cache hits, on both systems, and measure the cache instead."""
    return int(args.seed + args.rate_list.index(rate))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench_vs_vllm", description=__doc__)
    _add_workload_args(p)
    _add_server_args(p)
    _add_report_args(p)
    args = p.parse_args(argv)
    args.rate_list = parse_rates(args.rates)
    args.system_list = _names(args.systems, SYSTEMS, "--systems")
    if not (args.tbt_slo_ms or args.report_only or "vllm" in args.system_list):
        # Refused before any server starts: the report, written after every run, would have
        # no SLO to apply and the runs would be left without one.
        p.error("--systems without vllm needs --tbt-slo-ms: the SLOs derive from vLLM's runs")
    args.workload_list = _names(args.workloads, WORKLOADS, "--workloads")
    # Ours is asked as the user asks `up`: auto lets a tune-layout measurement pick the dtype.
    args.sarathi_dtype = args.dtype
    args.dtype = native_dtype() if args.dtype == "auto" else args.dtype
    return args


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """What is run and where its results go: the model, the rates, the systems, the workloads'
    shapes and the dtype."""
    p.add_argument("--model", type=Path, default=REPO / ".cache/models/smollm2-135m-instruct")
    p.add_argument("--results", type=Path, default=REPO / "bench-results/vs-vllm")
    p.add_argument("--rates", default="0.25,0.5,0.75,1,1.5,inf", help="req/s, comma-separated")
    p.add_argument("--num-prompts", type=int, default=12, help="requests per rate")
    p.add_argument("--systems", default="vllm,sarathi", help=f"some of {','.join(SYSTEMS)}")
    p.add_argument(
        "--workloads", default="random,conversation", help=f"some of {','.join(WORKLOADS)}"
    )
    p.add_argument("--random-input-len", type=int, default=512)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument(
        "--prefix",
        default="4,512,64,64",
        help="the prefix workload: NUM_PREFIXES,PREFIX_LEN,SUFFIX_LEN,OUTPUT_LEN",
    )
    p.add_argument(
        "--multiturn",
        default="4,4,256,64,64",
        help="the multiturn workload: CHATS,TURNS,FIRST_LEN,QUESTION_LEN,OUTPUT_LEN (lengths "
        "multiples of 16); its requests per rate are CHATS x TURNS, not --num-prompts",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="both systems' dtype (auto: vLLM in bfloat16 where the CPU computes it natively, "
        "AVX512-BF16 or AMX, else float32; ours with `up --dtype auto`: that rule, or the dtype "
        "`sarathictl tune-layout` measured faster here)",
    )
    p.add_argument("--trace", type=Path, default=TRACE, help="conversation trace CSV")
    p.add_argument(
        "--trace-scale",
        type=float,
        default=0.5,
        help="trace lengths times this (0.5: the trace's longest request fits 8,192 tokens)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the prompts' seed: the first rate's (each later rate adds its index) and the "
        "trace sample's",
    )


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """How each system is started."""
    p.add_argument("--vllm-bin", type=Path, default=Path(sys.executable).parent / "vllm")
    p.add_argument("--sarathictl", type=Path, default=REPO / ".venv/bin/sarathictl")
    p.add_argument(
        "--sarathi-budget", type=int, default=0, help="ours with this token budget (0: up's)"
    )
    p.add_argument(
        "--sarathi-args",
        default="",
        help="more flags for ours' `sarathictl up`, one string (e.g. \"--time-budget 0.05 "
        '--step-cost 0.004,7e-5,1e-7"); needs --sarathi-label',
    )
    p.add_argument("--sarathi-label", default="", help="names ours as sarathi-LABEL in the results")
    p.add_argument("--vllm-port", type=int, default=8100)
    p.add_argument("--sarathi-port", type=int, default=8200)
    p.add_argument("--vllm-kv-cache-gib", type=int, default=1)
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="both systems' prefix caches off (on by default, as both ship)",
    )


def _add_report_args(p: argparse.ArgumentParser) -> None:
    """The SLOs the report applies, the passes, and a report alone."""
    p.add_argument(
        "--slo-factors",
        default="5,25",
        help="TBT SLOs as multiples of vLLM's median TBT at the lowest rate (strict, relaxed)",
    )
    p.add_argument("--tbt-slo-ms", default="", help="fixed TBT SLOs instead, ms, e.g. 115,574")
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: a second pass with the systems in the opposite order under the first's SLOs "
        "(RESULTS/pass-a, RESULTS/pass-b), then both passes' targets side by side in "
        "RESULTS/targets.md: a drift in a shared machine's speed falls on both orders",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="no servers: the table, plot and capacity again from the results folder's runs",
    )


def native_dtype() -> str:
    """bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX), else float32: the rule
    of ours' `--dtype auto`, which vLLM gets too so that both compute the same way."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if "avx512_bf16" in flags or "amx_bf16" in flags else "float32"


def parse_rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise SystemExit(f"--rates: positive numbers or inf, got {text!r}")
    return sorted(rates)


def _names(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{flag}: choose from {', '.join(known)}; got {text!r}")
    return names


def say(message: str) -> None:
    print(f"[bench-vs-vllm {time.strftime('%H:%M:%S')}] {message}", flush=True)


def max_model_len(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    workloads = []
    for name in args.workload_list:
        if name == "random":
            workloads.append(random_workload(args.random_input_len, args.random_output_len))
        elif name == "multiturn":
            c, t, first, question, output = (int(v) for v in args.multiturn.split(","))
            chats = MultiTurn(c, t, first, question, output)
            jsonl = args.results / "datasets" / "multiturn.jsonl"
            say(f"{chats.name}: {write_multi_turn_dataset(chats, jsonl)} requests ({jsonl})")
            workloads.append(trace_workload(chats.name, jsonl, c * t))
        elif name == "prefix":
            num, prefix, suffix, output = (int(v) for v in args.prefix.split(","))
            workloads.append(prefix_workload(prefix, suffix, num, output))
        else:
            jsonl = args.results / "datasets" / "conversation.jsonl"
            rows = write_trace_dataset(
                args.trace, jsonl, args.trace_scale, max_model_len(args.model),
                args.num_prompts, args.seed,
            )  # fmt: skip
            prompts = sorted(r.prompt_tokens for r in rows)
            outputs = sorted(r.output_tokens for r in rows)
            say(
                f"conversation trace x{args.trace_scale:g}: {len(rows)} requests, prompt "
                f"median {prompts[len(prompts) // 2]} max {prompts[-1]}, output median "
                f"{outputs[len(outputs) // 2]} max {outputs[-1]} tokens ({jsonl})"
            )
            workloads.append(trace_workload(f"conversation-x{args.trace_scale:g}", jsonl))
    return workloads


def server_spec(system: str, args: argparse.Namespace) -> ServerSpec:
    caching = not args.no_prefix_caching
    if system.startswith("vllm"):
        return vllm_spec(
            args.vllm_bin, args.model, args.model.name, args.vllm_port,
            args.vllm_kv_cache_gib, args.dtype, caching, pp=2 if system == "vllm-pp2" else 1,
            stage_logs=args.results / "stages",
        )  # fmt: skip
    extra = tuple(shlex.split(args.sarathi_args))
    label = args.sarathi_label
    if system in ("sarathi-pp1", "sarathi-pp2"):
        depth = system.removeprefix("sarathi-")
        extra, label = ("--pp", depth[2:], *extra), "-".join(filter(None, (depth, label)))
    return sarathi_spec(
        args.sarathictl, args.model, args.sarathi_port, args.sarathi_dtype, caching,
        args.sarathi_budget, extra, label, stage_logs=args.results / "stages",
    )  # fmt: skip


def result_path(args: argparse.Namespace, system: str, workload: str, rate: float) -> Path:
    return args.results / "raw" / f"{system}_{workload}_{rate_flag(rate)}qps.json"


def run_one(args: argparse.Namespace, spec: ServerSpec, workload: Workload, rate: float) -> Row:
    out = result_path(args, spec.name, workload.name, rate)
    out.unlink(missing_ok=True)
    seed = run_seed(args, rate)
    command = bench_command(
        args.vllm_bin, spec.base_url, args.model.name, args.model, workload, rate,
        workload.num_prompts or args.num_prompts, seed, out,
    )  # fmt: skip
    run_bench(command, out.with_suffix(".log"), client_env(seed))
    if spec.stage_log is not None:
        save_bubbles(spec.stage_log, out)
    return load_row(out, spec.name, workload.name)


def save_bubbles(stage_log: Path, result: Path) -> None:
    """The run's bubbles from its stages' steps and its requests, beside its result."""
    steps = stage_steps(stage_log)
    if not steps:
        return  # no step written (a server that never ran one): nothing to measure
    measured = asdict(run_bubbles(steps, request_spans(json.loads(result.read_text()))))
    # NaN (no steady state) as null: the file stays standard JSON
    saved = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in measured.items()}
    stages_path(result).write_text(json.dumps(saved, indent=2) + "\n")


def warm_up(args: argparse.Namespace, spec: ServerSpec) -> None:
    """A few short requests first, so that neither system's first measured run pays for a
    first-call cost (vLLM compiles graphs for new shapes; ours builds its kernels)."""
    command = bench_command(
        args.vllm_bin, spec.base_url, args.model.name, args.model, random_workload(64, 8),
        math.inf, 4, args.seed + WARM_UP_SEED_OFFSET, None,
    )  # fmt: skip
    log = args.results / "logs" / f"{spec.name}-warmup.log"
    run_bench(command, log, client_env(args.seed + WARM_UP_SEED_OFFSET))


def run_system(
    args: argparse.Namespace, system: str, workloads: list[Workload], progress: list[int]
) -> list[Row]:
    """Every workload at every rate against one server, started here and always stopped."""
    spec = server_spec(system, args)
    log = args.results / "logs" / f"{system}-server.log"
    say(f"starting {system}: {' '.join(spec.command)} (log: {log})")
    rows = []
    with serving(spec, log) as startup_s:
        say(f"{system} serving after {startup_s:.0f} s; warming up")
        warm_up(args, spec)
        for workload in workloads:
            for rate in args.rate_list:
                progress[0] += 1
                started = time.monotonic()
                row = run_one(args, spec, workload, rate)
                rows.append(row)
                say(
                    f"[{progress[0]}/{progress[1]}] {system} {workload.name} rate "
                    f"{rate_flag(rate)}: {row.completed} done, {row.failed} failed, "
                    f"{row.request_throughput:.2f} req/s, TPOT p50/p99 "
                    f"{row.median_tpot_ms:.0f}/{row.p99_tpot_ms:.0f} ms, TTFT p50/p99 "
                    f"{row.median_ttft_ms:.0f}/{row.p99_ttft_ms:.0f} ms, TBT p99 "
                    f"{row.p99_itl_ms:.0f} ms ({time.monotonic() - started:.0f} s, load "
                    f"{os.getloadavg()[0]:.1f})"
                )
    say(f"{system} stopped")
    return rows


def slos(args: argparse.Namespace, rows: list[Row]) -> dict[str, float]:
    """Named TBT SLOs in ms: fixed ones from --tbt-slo-ms, else multiples of vLLM's median TBT
    at its lowest rate on the random workload (on the conversation one if that alone ran)."""
    if args.tbt_slo_ms:
        fixed = [float(v) for v in args.tbt_slo_ms.split(",") if v.strip()]
        return {f"{_slo_name(i)} (fixed)": v for i, v in enumerate(fixed)}
    factors = [float(f) for f in args.slo_factors.split(",") if f.strip()]
    base = [r for r in rows if r.system == "vllm"]
    base = [r for r in base if r.workload.startswith("random")] or base
    if not base:
        raise SystemExit("the SLO comes from vLLM's runs: run vllm too, or give --tbt-slo-ms")
    return {
        f"{_slo_name(i)} ({f:g}x)": slo_from_light_load(base, "vllm", f)
        for i, f in enumerate(factors)
    }


def _slo_name(index: int) -> str:
    return ("strict", "relaxed")[index] if index < 2 else f"slo{index + 1}"


def machine() -> str:
    try:
        cpu = cpu_description(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = "unknown CPU"
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
"""The CPU flags that decide which kernels and dtype both engines run."""


def cpu_description(cpuinfo: str) -> str:
    """The first CPU's model name, family and model, and which of KERNEL_FLAGS it has: a
    virtual machine may name two generations alike ("AMD EPYC"), and their figures must never
    be compared."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first CPU's block ends
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    has = [f for f in KERNEL_FLAGS if f in flags] or ["none of " + " ".join(KERNEL_FLAGS)]
    family = ""
    if "cpu family" in fields and "model" in fields:
        family = f"family {fields['cpu family']}, model {fields['model']}; "
    return f"{fields.get('model name', 'unknown CPU')} ({family}{' '.join(has)})"


def write_report(args: argparse.Namespace, rows: list[Row], meta: dict[str, object]) -> Path:
    slo_ms = slos(args, rows)
    png = args.results / "vs-vllm.png"
    plot(rows, png, slo_ms)
    caps = {
        name: {
            f"{w}/{s}": capacity([r for r in rows if r.workload == w and r.system == s], v)
            for w in sorted({r.workload for r in rows})
            for s in sorted({r.system for r in rows})
        }
        for name, v in slo_ms.items()
    }
    report = args.results / "report.md"
    report.write_text(
        f"# vLLM side by side ({meta['date']})\n\n"
        f"Machine: {meta['machine']}; load average before/after: {meta['load_before']} / "
        f"{meta['load_after']}. vLLM {meta['vllm_version']}; {args.num_prompts} requests per "
        f"rate; {_dtypes(meta)}, prefix caching "
        f"{'on' if meta.get('prefix_caching', False) else 'off'}; wall time "
        f"{_wall_time(meta)}.\n\n"
        + markdown_table(rows)
        + "\n\nCapacity: the highest rate with P99 TBT (ITL) within the SLO and median TTFT "
        f"within {MAX_MEDIAN_TTFT_S:g} s, every lower rate passing too. SLOs: "
        + ", ".join(f"{n} {v:.0f} ms" for n, v in slo_ms.items())
        + (
            " (fixed)"
            if args.tbt_slo_ms
            else " (multiples of vLLM's median TBT at its lowest rate)"
        )
        + ".\n\n"
        + capacity_table(rows, slo_ms)
        + section(
            TARGETS_INTRO,
            targets_table([verdicts(rows, strict_slo_ms(slo_ms))], ["this run"]),
        )
        + section(TTFT_SPLIT_INTRO, ttft_split_table(rows))
        + section(BUBBLE_INTRO, bubble_table(rows))
        + section(CAUSES_INTRO, all_causes_tables(args.results))
        + section(BOUND_INTRO, all_bound_tables(args.results))
        + f"\n\n![TPOT and TTFT against request rate]({png.name})\n"
    )
    summary = {
        **meta,
        "slo_ms": slo_ms,
        "capacity_req_s": caps,
        "rows": [{**asdict(r), "rate": rate_flag(r.rate)} for r in rows],
    }
    (args.results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return report


TARGETS_INTRO = (
    "Issue 30's targets in this run, under the first (strict) SLO (targets.py, which says which "
    "system stands for whom; `python -m bench_vs_vllm.targets DIR [DIR ...]` puts several "
    "passes side by side)."
)
TTFT_SPLIT_INTRO = (
    "TTFT by what a request met on arrival: no other request in the system (alone) or some "
    "(beside others), medians and counts (ttft_split.py). Alone, a prompt is prefilled at once "
    "by both; beside decodes, ours goes in budget-sized chunks while vLLM's goes whole and "
    "holds the decodes back."
)
BUBBLE_INTRO = (
    "Pipeline bubbles: the time each stage was idle while some request was in the system, over "
    "that time plus its busy time, the mean over stages (bubbles.py); the steady state is the "
    "middle 80% of the arrivals. Of the steady-state bubble, the part while one request was "
    "alone in the system: while it decodes, its tokens follow one another, so a pipeline holds "
    "one micro-batch and each stage waits while the other runs it, whatever the schedule (its "
    "prompt's chunks can overlap)."
)

CAUSES_INTRO = (
    "Where ours' bubble goes (bubble_causes.py), over each whole run: each stage's idle time "
    "while requests were in the system, split by what the pipeline held then: no micro-batch "
    "in flight; one (largely a request alone); two or more with the other stage working on "
    "decodes alone, or on a prompt chunk (the stages' imbalance for that kind, and a "
    "result's trip through the controller); two or more with both stages idle (hand-off)."
)
BOUND_INTRO = (
    "What would give ours' idle time back (pipeline_bound.py): each run's micro-batches "
    "replayed with every trip between stages and through the controller taking no time. As "
    "shares of the run's time, beside the stages' mean work: the layer split (the busiest "
    "stage's work over the mean: no schedule does better on these layers), dependencies "
    "(micro-batches waiting for the tokens they need, e.g. a request alone), trips (the run "
    "past the replay), and no requests in the system (idle, not bubble)."
)


def section(intro: str, table: str) -> str:
    """A report section after the ones before it; "" when its table is empty (nothing measured)."""
    return f"\n\n{intro}\n\n{table}" if table else ""


def saved_rows(args: argparse.Namespace) -> list[Row]:
    """Every run saved in the results folder (`<system>_<workload>_<rate>qps.json`), so that
    runs of one system made apart (--systems) report together."""
    rows = []
    for path in sorted((args.results / "raw").glob("*_*_*qps.json")):
        system, workload, _ = path.name.split("_")
        rows.append(load_row(path, system, workload))
    return rows


def _wall_time(meta: dict[str, object]) -> str:
    wall_s = meta.get("wall_s")
    return f"{wall_s:.0f} s" if isinstance(wall_s, (int, float)) else "not recorded"


def meta_of_saved_runs(args: argparse.Namespace) -> dict[str, object]:
    """The report's header where the folder has runs but no summary (a run that stopped before
    its report): what the saved runs and this machine tell, the rest marked unknown."""
    dates = sorted(
        str(json.loads(path.read_text()).get("date", ""))
        for path in (args.results / "raw").glob("*_*_*qps.json")
    )
    first = dates[0] if dates else ""
    date = (
        time.strftime("%Y-%m-%d %H:%M", time.strptime(first, "%Y%m%d-%H%M%S"))
        if len(first) == 15
        else "unknown"
    )
    return {
        "date": f"{date}, the first run's",
        "machine": machine(),
        "load_before": "n/a",
        "load_after": "n/a",
        "vllm_version": vllm_version(),
        "num_prompts": args.num_prompts,
        "dtype": args.dtype,
        "sarathi_dtype": args.sarathi_dtype,
        "prefix_caching": not args.no_prefix_caching,
    }


def _dtypes(meta: dict[str, object]) -> str:
    """The report's words for the dtypes: runs before session 24 gave both the same one."""
    dtype = meta.get("dtype", "bfloat16")
    if meta.get("sarathi_dtype", dtype) != "auto":
        return f"both in {dtype}"
    return (
        f"vLLM in {dtype}, ours with `up --dtype auto` ({dtype} by its rule, unless "
        "`sarathictl tune-layout` measured another faster here: the first lines of ours' log "
        "in logs/ say which)"
    )


def vllm_version() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:  # run outside install_vllm.sh's venv
        return "not installed here"


def report_again(args: argparse.Namespace) -> int:
    """Rewrites the report from the saved runs and the metadata of the last run (or, without
    a summary, what the runs themselves tell)."""
    rows = saved_rows(args)
    if not rows:
        say(f"no runs in {args.results / 'raw'}: nothing to report")
        return 2
    summary_path = args.results / "summary.json"
    if summary_path.is_file():
        meta = json.loads(summary_path.read_text())
        for key in ("rows", "slo_ms", "capacity_req_s"):
            meta.pop(key, None)
    else:
        say(f"no {summary_path}: the header from the saved runs")
        meta = meta_of_saved_runs(args)
    report = write_report(args, rows, meta)
    print(report.read_text(), flush=True)
    return 0


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through `serving`, which stops it


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    if not (args.model / "config.json").is_file():
        say(f"no model at {args.model}: run `sarathictl model prepare-demo` first")
        return 2
    ours = any(s.startswith("sarathi") for s in args.system_list)
    tools = [args.vllm_bin] + ([args.sarathictl] if ours else [])
    for tool in tools:
        if not os.access(tool, os.X_OK):
            say(f"{tool} is missing or not executable (install_vllm.sh / make install)")
            return 2
    if args.report_only:
        return report_again(args)
    return run_pass(args) if args.passes == 1 else run_two_passes(args)


def run_two_passes(args: argparse.Namespace) -> int:
    """Pass A as asked, pass B in the opposite order under A's SLOs, then both passes' targets
    side by side in RESULTS/targets.md."""
    first = pass_args(args, "pass-a")
    code = run_pass(first)
    if code != 0:
        return code
    summary_a = json.loads((first.results / "summary.json").read_text())
    second = second_pass(args, summary_a)
    code = run_pass(second)
    if code != 0:
        return code
    summary_b = json.loads((second.results / "summary.json").read_text())
    table = targets_table(
        [verdicts_of_summary(summary_a), verdicts_of_summary(summary_b)], ["pass A", "pass B"]
    )
    targets = args.results / "targets.md"
    targets.write_text(
        f"# Issue 30's targets, two passes ({summary_a['date']}, {summary_a['machine']})\n\n"
        f"Pass A: {', '.join(first.system_list)}; pass B: {', '.join(second.system_list)}, "
        f"under pass A's SLOs ({second.tbt_slo_ms} ms).\n\n{table}\n"
    )
    print(targets.read_text(), flush=True)
    return 0


def pass_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """The arguments of one pass: its results in a folder of its own."""
    return argparse.Namespace(**{**vars(args), "results": args.results / name, "passes": 1})


def second_pass(args: argparse.Namespace, first_summary: dict[str, object]) -> argparse.Namespace:
    """Pass B: the systems in the opposite order, under the SLOs pass A took from vLLM (so both
    passes judge capacity by the same bound)."""
    slos = first_summary["slo_ms"]
    assert isinstance(slos, dict), "pass A's summary has no SLOs"
    second = pass_args(args, "pass-b")
    second.system_list = list(reversed(args.system_list))
    second.tbt_slo_ms = ",".join(f"{float(v):.3f}" for v in slos.values())
    return second


def run_pass(args: argparse.Namespace) -> int:
    """One pass: every system over every workload and rate, then its report."""
    args.results.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    meta: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "load_before": f"{os.getloadavg()[0]:.2f}",
        "vllm_version": vllm_version(),
        "model": str(args.model),
        "rates": [rate_flag(r) for r in args.rate_list],
        "num_prompts": args.num_prompts,
        "dtype": args.dtype,
        "sarathi_dtype": args.sarathi_dtype,
        "prefix_caching": not args.no_prefix_caching,
    }
    workloads = build_workloads(args)
    progress = [0, len(args.system_list) * len(workloads) * len(args.rate_list)]
    rows: list[Row] = []
    try:
        for system in args.system_list:
            rows += run_system(args, system, workloads, progress)
    except (ServerError, BenchError) as err:
        say(f"FAILED: {err}")
        return 1
    except KeyboardInterrupt:
        say("interrupted; the server was stopped")
        return 130
    meta["load_after"] = f"{os.getloadavg()[0]:.2f}"
    meta["wall_s"] = time.monotonic() - started
    report = write_report(args, rows, meta)
    print(report.read_text(), flush=True)
    say(f"done in {meta['wall_s']:.0f} s: {report}, {args.results / 'vs-vllm.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
