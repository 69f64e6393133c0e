"""`sarathictl status`: per-stage utilization, scheduler state, latency and throughput."""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console, Group, RenderableType
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
    add_kubernetes_flags(p)
    p.set_defaults(run=run)


def add_kubernetes_flags(p: argparse.ArgumentParser) -> None:
    k = p.add_argument_group(
        "Kubernetes",
        "With --kubernetes, every pipeline of a Helm release is found through the Kubernetes API "
        "(the chart's labels) and each stage's row shows its pod, node, readiness and restarts; "
        "a pipeline that is down names the pod missing and why. --addr is not used then.",
    )
    k.add_argument("--kubernetes", action="store_true", help="find the pipelines in Kubernetes")
    k.add_argument("--namespace", default="", help="namespace (default: the kubeconfig context's)")
    k.add_argument("--release", default="", help="Helm release (default: every release)")
    k.add_argument("--kubeconfig", default="", help="kubeconfig file (default: the usual one)")
    k.add_argument("--context", default="", help="kubeconfig context (default: the current)")
    k.add_argument(
        "--via",
        choices=("port-forward", "pod-ip"),
        default="port-forward",
        help="how controllers are reached: a port-forward through the API server made by the "
        "command (default), or the pod's IP (from inside the cluster)",
    )


def stage_label(s: generate_pb2.StageStatus) -> str:
    """A stage that is not serving says so beside its number (narrow terminals keep it)."""
    if s.stalled:
        return f"{s.stage} STALLED"
    if s.preparing_cache:
        return f"{s.stage} PREPARING"
    return str(s.stage) if s.up else f"{s.stage} DOWN"


def render(status: generate_pb2.StatusResponse) -> Group:
    stages, sched = stages_table(status), scheduler_table(status.scheduler)
    cache, latency = prefix_cache_table(status.scheduler.prefix_cache), latency_table(status)
    parts: list[RenderableType] = [stages, sched]
    if status.problem:
        parts.insert(0, f"[bold red]NOT SERVING: {status.problem}[/]")
    quarantine = quarantine_line(status.scheduler)
    if quarantine:
        parts.append(quarantine)
    return Group(*parts, cache, latency)


def quarantine_line(sc: generate_pb2.SchedulerStatus) -> str:
    """Said only when there is something to say: requests running alone after their
    micro-batch failed on a worker, and those ended with an error for it."""
    said = []
    if sc.num_suspects:
        said.append(
            f"{sc.num_suspects} requests run alone, one at a time, before anything else is "
            "admitted: their micro-batch failed on a worker"
        )
    if sc.num_quarantined:
        said.append(f"{sc.num_quarantined} ended with an error since start: theirs failed alone")
    return f"[bold yellow]quarantine: {'; '.join(said)}[/]" if said else ""


def stages_table(status: generate_pb2.StatusResponse) -> Table:
    stages = Table(title=f"{status.model}: pipeline stages", title_justify="left")
    columns = (
        "stage",
        "host (device)",
        "TP",
        "util %",
        "bubble %",
        "idle %",
        "step ms",
        "in flight",
    )
    for column in columns:
        stages.add_column(column, justify="left" if column == "host (device)" else "right")
    for s in status.stages:
        stages.add_row(
            stage_label(s),
            f"{s.host or '-'} ({s.device})" if s.device else s.host or "-",
            tp_cell(list(s.tp_ranks), status.scheduler.tensor_parallel),
            f"{s.utilization_pct:.1f}",
            f"{s.bubble_pct:.1f}",
            f"{s.idle_pct:.1f}",
            f"{s.step_time_p50_s * 1e3:.1f}",
            str(s.micro_batches_in_flight),
        )
    return stages


def tp_cell(connected_ranks: list[int], tp: int) -> str:
    """The stage's TP degree when every rank is connected, else which are: "0,1,3 of 4"."""
    if not connected_ranks:
        return "-"
    if len(connected_ranks) == tp:
        return str(tp)
    return ",".join(str(r) for r in connected_ranks) + (f" of {tp}" if tp else "")


def scheduler_table(sc: generate_pb2.SchedulerStatus) -> Table:
    title = "scheduler"
    if sc.tbt_slo_s:
        title += f" (budgets chosen for P99 TBT <= {sc.tbt_slo_s * 1e3:.0f} ms)"
    sched = Table(title=title, title_justify="left")
    for column in ("policy", "budget", "PPxTP", "waiting", "running", "KV %", "preemptions"):
        sched.add_column(column, justify="right")
    budget = str(sc.budget_tokens)
    if sc.time_budget_s:
        budget += f" / {sc.time_budget_s * 1e3:.0f} ms"
    if sc.idle_budget_tokens:
        budget += f" ({sc.idle_budget_tokens} idle)"
    sched.add_row(
        sc.policy or "-",
        budget,
        f"{sc.pipeline_depth}x{sc.tensor_parallel}",
        str(sc.num_waiting),
        f"{sc.num_running}/{sc.max_num_seqs}" if sc.max_num_seqs else str(sc.num_running),
        f"{sc.kv_usage_pct:.1f}",
        str(sc.num_preemptions),
    )
    return sched


def latency_table(status: generate_pb2.StatusResponse) -> Table:
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
    return latency


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}" if whole else "-"


def prefix_cache_table(pc: generate_pb2.PrefixCacheStatus) -> Table | str:
    """Hit rates since start: of the tokens admitted, those taken from the cache; of the
    sequences, those that started past a cached prefix."""
    if not pc.enabled:
        return "prefix cache: off (--no-prefix-caching)"
    table = Table(title="prefix cache (since start)", title_justify="left")
    for column in ("token hit %", "request hit %", "cached tokens", "cached blocks", "evictions"):
        table.add_column(column, justify="right")
    table.add_row(
        _pct(pc.num_cached_tokens, pc.num_prompt_tokens),
        f"{_pct(pc.num_hit_requests, pc.num_requests)} of {pc.num_requests}",
        f"{pc.num_cached_tokens}/{pc.num_prompt_tokens}",
        str(pc.num_cached_blocks),
        str(pc.num_evictions),
    )
    return table


def run(args: argparse.Namespace) -> int:
    if args.kubernetes:
        from sarathictl.kube.status_cmd import run_kubernetes  # loads the kubernetes package

        return run_kubernetes(args)
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
