"""`sarathictl status`: per-stage utilization, scheduler state, latency and throughput."""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from sarathi_proto import generate_pb2

from sarathictl.argtypes import float_above
from sarathictl.client import add_connection_flags, client_from_args, explain_rpc_error


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show each stage's utilization and the scheduler's state",
        description="Per stage, three shares of its wall time over the last 30 s, adding up to "
        "100%: util = the stage computing; bubble = the stage waiting while the pipeline has "
        "work (requests waiting or running); idle = no work in the system at all.",
    )
    add_connection_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument(
        "--interval", type=float_above(0.0), default=1.0, help="refresh period with --watch (s)"
    )
    p.set_defaults(run=run)


def render(status: generate_pb2.StatusResponse) -> Group:
    stages = Table(title=f"{status.model}: pipeline stages", title_justify="left")
    columns = (
        "stage",
        "host",
        "TP",
        "util %",
        "bubble %",
        "idle %",
        "step ms",
        "in flight",
    )
    for column in columns:
        stages.add_column(column, justify="right" if column not in ("host",) else "left")
    for s in status.stages:
        stages.add_row(
            # A stage that is not serving says so beside its number (narrow terminals keep it).
            f"{s.stage} STALLED" if s.stalled else (str(s.stage) if s.up else f"{s.stage} DOWN"),
            s.host or "-",
            ",".join(str(r) for r in s.tp_ranks) or "-",
            f"{s.utilization_pct:.1f}",
            f"{s.bubble_pct:.1f}",
            f"{s.idle_pct:.1f}",
            f"{s.step_time_p50_s * 1e3:.1f}",
            str(s.micro_batches_in_flight),
        )
    sc = status.scheduler
    title = "scheduler"
    if sc.tbt_slo_s:
        title += f" (budgets chosen for P99 TBT <= {sc.tbt_slo_s * 1e3:.0f} ms)"
    sched = Table(title=title, title_justify="left")
    for column in ("policy", "budget", "PPxTP", "waiting", "running", "KV %", "preemptions"):
        sched.add_column(column, justify="right")
    budget = str(sc.budget_tokens)
    if sc.time_budget_s:
        budget += f" / {sc.time_budget_s * 1e3:.0f} ms"
    sched.add_row(
        sc.policy or "-",
        budget,
        f"{sc.pipeline_depth}x{sc.tensor_parallel}",
        str(sc.num_waiting),
        f"{sc.num_running}/{sc.max_num_seqs}" if sc.max_num_seqs else str(sc.num_running),
        f"{sc.kv_usage_pct:.1f}",
        str(sc.num_preemptions),
    )
    lat = status.latency
    latency = Table(title="latency (recent window) and throughput", title_justify="left")
    for column in ("TTFT P50 ms", "TTFT P99 ms", "TBT P50 ms", "TBT P99 ms", "tokens/s"):
        latency.add_column(column, justify="right")
    latency.add_row(
        f"{lat.ttft_p50_s * 1e3:.1f}",
        f"{lat.ttft_p99_s * 1e3:.1f}",
        f"{lat.tbt_p50_s * 1e3:.1f}",
        f"{lat.tbt_p99_s * 1e3:.1f}",
        f"{status.throughput_tokens_per_s:.1f}",
    )
    if status.problem:
        return Group(f"[bold red]NOT SERVING: {status.problem}[/]", stages, sched, latency)
    return Group(stages, sched, latency)


def run(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        try:
            if args.json:
                status = client.status()
                print(json.dumps(MessageToDict(status, always_print_fields_with_no_presence=True)))
                return 0
            console = Console()
            if not args.watch:
                console.print(render(client.status()))
                return 0
            with Live(render(client.status()), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(args.interval)
                    live.update(render(client.status()), refresh=True)
        except grpc.RpcError as err:
            print(f"sarathictl: {explain_rpc_error(err, args.addr)}", file=sys.stderr)
            return 1
