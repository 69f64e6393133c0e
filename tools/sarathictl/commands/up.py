"""`sarathictl up --local`: a controller and its PP x TP stage workers as processes here."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading

from controller.budget_flags import add_budget_flags
from controller.scheduler import policy_names
from controller.scheduler.config import CHUNKED_POLICIES
from sarathictl.argtypes import comma_list, device, float_in, int_at_least, one_of, port
from sarathictl.layout_choice import (
    machine_layout,
    threads_per_worker,
)
from sarathictl.layout_file import default_layout_file
from sarathictl.local_cluster import (
    LOCAL_BUDGET_TOKENS,
    LocalCluster,
    LocalClusterConfig,
    connect_host,
    pinned_cpus,
)
from stage_worker.cpu_pinning import format_cpu_list
from stage_worker.dtype_names import DTYPE_NAMES


def resolve_model(model: str) -> str:
    """`demo` means the demo model, prepared (once, cached) if missing."""
    if model != "demo":
        return model
    from sarathictl.model_prep.prepare import PrepareOptions, prepare_model

    return str(prepare_model(PrepareOptions()).model_dir)


def describe_layout(config: LocalClusterConfig, args: argparse.Namespace) -> str:
    """What `up` runs and why, in a few lines: each choice it made rather than the user."""
    cores = len(os.sched_getaffinity(0))
    workers = config.pp * config.tp
    lines = [f"layout: PP={config.pp} x TP={config.tp} on {cores} cores, {config.device}"]
    if not args.threads:
        lines.append(
            f"  {config.threads_per_worker} torch thread(s) per worker: the cores shared out "
            f"among {workers} worker(s) (--threads to choose)"
        )
    pinned = [pinned_cpus(config, worker) for worker in range(workers)]
    if any(pinned):
        where = ", ".join(format_cpu_list(cpus) for cpus in pinned)
        lines.append(
            f"  each worker pinned to its own core(s), by rank: {where} (--no-pin-cpus to let "
            "the OS place them)"
        )
    layout_file = getattr(args, "layout_file", "")
    choice = machine_layout(
        config.device, args.dtype, config.model_dir, layout_file, config.tp, args.pp
    )
    auto = choice.auto
    if args.dtype == "auto":
        lines.append(f"  {config.dtype}: {choice.why_dtype} (--dtype to choose)")
    if config.pp > 1 and not config.layer_split:
        lines.append("  layers: the LM head's stage holds fewer (--layer-split to choose)")
    if args.pp is None:
        lines.append(f"  {auto.why}")
    at = choice.budgets_at(config.pp, config.device)
    if args.budget is None and at is not None and at.why_budget:
        lines.append(f"  {at.why_budget}")
    if getattr(args, "idle_budget", 0) is None and config.idle_budget_tokens and at is not None:
        lines.append(f"  {at.why_idle_budget}")
    return "\n".join(lines)


WORKER_FLAGS = (
    *(
        f"--{prefix}{name}"
        for name in ("cpu-layer-loop", "cpu-matmul-kernel", "fused-ops", "cuda-graphs")
        for prefix in ("", "no-")
    ),
    "--small-batch-kernel",
)
"""The stage workers' kernel switches `--worker-flag` passes on (the rest of a worker's flags
`up` sets itself), to compare a kernel with the path it replaces on a live cluster."""


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="model folder, or `demo` (SmolLM2-135M)")
    positive = int_at_least(1)
    p.add_argument(
        "--pp",
        type=positive,
        default=2,
        help="pipeline stages (`up`: picked for the machine when not given, and said why; "
        "the benchmarks and `demo`: 2)",
    )
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel ranks per stage")
    p.add_argument(
        "--layer-split",
        type=comma_list(positive, allow_empty=True),
        default=(),
        help="decoder layers per stage, e.g. 17,13 (default: the workers' split, which gives "
        "the LM head's stage fewer layers)",
    )
    p.add_argument("--policy", default="sarathi", choices=policy_names(), help="batching policy")
    p.add_argument(
        "--budget",
        type=positive,
        default=LOCAL_BUDGET_TOKENS,
        help=f"token budget per micro-batch (default {LOCAL_BUDGET_TOKENS}: sized for CPU workers; "
        "`up` takes the one measured for its machine's layout at that depth and says why)",
    )
    p.add_argument(
        "--device",
        type=device(),
        default="cpu",
        help="where the workers run: cpu, cuda (this machine's GPUs shared out; workers that "
        "share a GPU link over gloo) or cuda:N (default cpu)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *sorted(DTYPE_NAMES)],
        help="worker dtype (auto: bfloat16 on a GPU, and on a CPU that computes it natively, "
        "AVX512-BF16 or AMX; else float32; for `up`, the dtype `sarathictl tune-layout` "
        "measured fastest here, if it has)",
    )
    p.add_argument(
        "--threads",
        type=int_at_least(0),
        default=0,
        help="torch threads per worker process (0: this machine's cores shared out among the "
        "workers, at least 1)",
    )
    p.add_argument(
        "--no-pin-cpus",
        action="store_true",
        help="CPU workers, several of them: let the OS place them (default: each pinned to "
        "its own --threads cores: PP=2 on 2 cores served more at saturation with a smaller "
        "bubble, BENCHMARKS.md, session 31)",
    )
    p.add_argument("--kv-cache-mb", type=positive, default=256, help="KV cache per worker, MiB")
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt from its first token (default: reuse cached prefixes)",
    )
    p.add_argument("--log-dir", default="", help="where process logs go (default: a temp dir)")
    p.add_argument(
        "--worker-flag",
        type=one_of("stage worker flag", WORKER_FLAGS),
        action="append",
        default=[],
        metavar="FLAG",
        help="a kernel switch for every stage worker, written with `=`, e.g. "
        "--worker-flag=--no-cpu-layer-loop (repeatable; `python -m stage_worker --help` says "
        "what each does)",
    )


def cluster_config(
    args: argparse.Namespace, port: int, http_port: int | None = None
) -> LocalClusterConfig:
    model_dir = resolve_model(args.model)
    layout_file = getattr(args, "layout_file", "")  # up's alone (add_layout_file_flag)
    choice = machine_layout(args.device, args.dtype, model_dir, layout_file, args.tp, args.pp)
    auto, dtype = choice.auto, choice.dtype
    pp = args.pp or auto.pp
    # The budgets measured for a depth go with it, whether up picked the depth or it was given.
    at = choice.budgets_at(pp, args.device)
    budget = args.budget or (at.budget_tokens if at is not None else LOCAL_BUDGET_TOKENS)
    idle_budget = getattr(args, "idle_budget", 0)  # None: up's own pick
    if idle_budget is None:
        # Not in SLO mode: the controller chooses the budget there, and the idle budget may not
        # be under it.
        idle = at.idle_budget_tokens if at is not None else 0
        chunked = args.policy in CHUNKED_POLICIES and idle >= budget
        slo_mode = bool(getattr(args, "tbt_slo", 0))
        idle_budget = idle if chunked and not slo_mode else 0
    return LocalClusterConfig(
        model_dir=model_dir,
        pp=pp,
        tp=args.tp,
        layer_split=args.layer_split,
        policy=args.policy,
        budget_tokens=budget,
        idle_budget_tokens=idle_budget,
        host=getattr(args, "host", "127.0.0.1"),
        port=port,
        http_port=http_port,
        metrics_port=getattr(args, "metrics_port", 0),
        dtype=dtype,
        device=args.device,
        threads_per_worker=args.threads or threads_per_worker(pp * args.tp),
        pin_cpus=not args.no_pin_cpus,
        kv_cache_bytes=args.kv_cache_mb << 20,
        log_dir=args.log_dir,
        prefix_caching=not args.no_prefix_caching,
        extra_worker_args=tuple(args.worker_flag),
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="start a cluster (local mode: processes on this machine)")
    p.add_argument("--local", action="store_true", required=True, help="local mode (required)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the controller's gRPC, HTTP and metrics ports listen on (default "
        "127.0.0.1: this machine only; 0.0.0.0: every interface)",
    )
    p.add_argument(
        "--port",
        type=port("any free port"),
        default=50051,
        help="gRPC port of the controller (0: any free port)",
    )
    p.add_argument(
        "--http-port",
        type=port("off"),
        default=0,
        help="OpenAI-compatible HTTP API port, with Prometheus /metrics beside it (0: off)",
    )
    p.add_argument(
        "--metrics-port",
        type=port("off"),
        default=0,
        help="Prometheus /metrics on its own port (0: off)",
    )
    p.add_argument(
        "--step-log", default="", metavar="FILE", help="one JSON line per micro-batch (README)"
    )
    p.add_argument(
        "--default-max-tokens",
        type=int_at_least(1),
        default=256,
        help="max_tokens of a gRPC or chat request that sets none (default 256; the "
        "completions API keeps OpenAI's 16), or what the model's context leaves after the "
        "prompt where that is less",
    )
    add_cluster_flags(p)
    add_layout_file_flag(p)
    add_reliability_flags(p)
    add_budget_flags(p)
    # up alone picks the depth and the budgets for the machine (default_layout); the benchmarks
    # and demo keep PP=2 and LOCAL_BUDGET_TOKENS
    p.set_defaults(run=run, pp=None, budget=None, idle_budget=None, decode_ahead=None)


def budget_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The controller flags of add_budget_flags that are set."""
    flags: list[str] = []
    if args.step_cost:
        flags += ["--step-cost", args.step_cost]
    if args.time_budget:
        flags += ["--time-budget", str(args.time_budget)]
    if args.tbt_slo:
        flags += ["--tbt-slo", str(args.tbt_slo)]
    if not args.spread_prompts:
        flags.append("--no-spread-prompts")
    if not decode_ahead_for(args.decode_ahead)[0]:
        flags.append("--no-decode-ahead")
    return tuple(flags)


def decode_ahead_for(asked: bool | None) -> tuple[bool, str]:
    """Whether a local cluster's controller schedules decodes ahead of their tokens (PP=1),
    and why. On by default on a CPU too: the stage finds its next plan waiting, which on the
    2-core Zen 3 EPYC cut TPOT to 0.85x-0.87x at 8 streams, and at saturation the
    controller's work, which then overlaps the step on the same cores, cost 0.94x-0.99x the
    requests, within the runs' spread (BENCHMARKS.md, issue 30 sessions 38 and 39)."""
    if asked is not None:
        return asked, "as asked"
    return True, "the stage finds its next plan waiting (--no-decode-ahead to wait for each token)"


def add_layout_file_flag(p: argparse.ArgumentParser) -> None:
    """up's alone: demo and the benchmarks run the rule's layout, whatever this machine has
    measured, so that their figures do not depend on a file in the user's cache."""
    p.add_argument(
        "--layout-file",
        default=str(default_layout_file()),
        help="where `sarathictl tune-layout` keeps what it measured fastest here: `up` then "
        "runs that layout when --pp is not given, and with --dtype auto that dtype (default: "
        "$SARATHI_LAYOUT_FILE, else ~/.cache/sarathi-cluster/layouts.json; empty: the rule's)",
    )


def add_reliability_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-restart", action="store_true", help="stop everything when a process exits")
    # The controller's own bounds (ServerConfig, AdmissionConfig), checked before it starts.
    p.add_argument(
        "--heartbeat-timeout",
        type=float_in(0.5, 3600.0),
        default=5.0,
        help="s before a stage is down",
    )
    p.add_argument(
        "--stall-timeout",
        type=float_in(0.5, 86400.0),
        default=30.0,
        help="s without a step: unhealthy",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int_at_least(1),
        default=1024,
        help="admission queue bound",
    )
    p.add_argument("--while-down", default="hold", choices=["hold", "fail"], help="new requests")
    p.add_argument("--auth-token-file", default="", help="bearer tokens, one per line")
    p.add_argument("--tls-cert", default="", help="PEM certificate of the gRPC and HTTP APIs")
    p.add_argument("--tls-key", default="", help="PEM key of --tls-cert")


def reliability_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The controller flags of add_reliability_flags."""
    flags = [
        "--heartbeat-timeout", str(args.heartbeat_timeout),
        "--stall-timeout", str(args.stall_timeout),
        "--max-queued-requests", str(args.max_queued_requests),
        "--while-down", args.while_down,
    ]  # fmt: skip
    for flag, value in (
        ("--auth-token-file", args.auth_token_file),
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
    ):
        if value:
            flags += [flag, value]
    return tuple(flags)


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    config = cluster_config(args, args.port, args.http_port or None)
    extra = reliability_args(args) + budget_args(args)
    extra += ("--default-max-tokens", str(args.default_max_tokens))
    if args.step_log:
        extra += ("--step-log", args.step_log)
    config = dataclasses.replace(config, extra_controller_args=extra)
    cluster = LocalCluster(config)
    print(describe_layout(config, args), file=sys.stderr)
    if config.pp == 1:
        ahead, why = decode_ahead_for(args.decode_ahead)
        print(
            f"  decodes ahead of their tokens: {'on' if ahead else 'off'}: {why}", file=sys.stderr
        )
    print(f"starting controller and {config.pp}x{config.tp} workers ...", file=sys.stderr)
    stop = threading.Event()
    try:
        # Ctrl-C or SIGTERM while starting: start() stops what it started on the way out. Set
        # for SIGINT too: a shell starts a background job with SIGINT ignored, and Python then
        # leaves it so.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _raise_interrupt)
        cluster.start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(serving_banner(cluster, args), file=sys.stderr)
        serve(cluster, stop, restart=not args.no_restart)
    except KeyboardInterrupt:
        print("sarathictl: interrupted while starting", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as err:  # a child died; not serving within 300 s
        print(f"sarathictl: {err}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        print("stopped: no process left behind", file=sys.stderr)
    return 0


def serving_banner(cluster: LocalCluster, args: argparse.Namespace) -> str:
    lines = [
        f"serving on {cluster.addr} (logs in {cluster.log_dir}); Ctrl-C stops everything",
        f'  sarathictl generate --addr {cluster.addr} "Hello"',
        f"  sarathictl status --addr {cluster.addr}",
    ]
    if cluster.http_port:
        url = cluster.http_base_url
        url = "https" + url.removeprefix("http") if args.tls_cert else url  # --tls-cert: HTTPS
        lines.append(f"  OpenAI-compatible API: {url}")
    if args.metrics_port:
        host = connect_host(cluster.config.host)
        lines.append(f"  Prometheus metrics: http://{host}:{args.metrics_port}/metrics")
    if cluster.config.host not in ("127.0.0.1", "::1", "localhost"):
        lines.append(
            f"  listening on {cluster.config.host}: other machines can reach these ports"
            + ("" if args.auth_token_file else "; --auth-token-file makes the APIs ask for a token")
        )
    return "\n".join(lines)


def serve(cluster: LocalCluster, stop: threading.Event, restart: bool) -> None:
    """Until `stop`: restarts a child that exits, or (restart off) raises RuntimeError."""
    while not stop.wait(0.2):
        if not restart:
            cluster.check_alive()
            continue
        for name in cluster.supervise():
            print(f"sarathictl: {name} exited; restarted it", file=sys.stderr)
