"""`python -m sarathictl.bench.reliability --model DIR`: the figures of RELIABILITY.md.

Starts a local cluster (supervised, so killed workers come back) and measures: a closed-loop
load held with zero errors, 10x that load (refusals, no hang, controller memory), a stage
killed with SIGKILL mid-stream (time to detect and to recover, requests lost), and optionally
a soak with the controller's memory sampled over time (and, with --memory-trace-dir, traced
inside by tracemalloc: controller/memory_trace.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sarathi_proto import generate_pb2, generate_pb2_grpc

from sarathictl.local_cluster import API_HEALTH_NAME, LocalCluster, LocalClusterConfig


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def one_call(stub: generate_pb2_grpc.GenerationStub, prompt: list[int], max_tokens: int) -> str:
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True
    )
    try:
        last = list(stub.Generate(request, timeout=120))[-1]
    except grpc.RpcError as err:
        return err.code().name
    return "OK" if last.finish_reason == generate_pb2.FINISH_REASON_LENGTH else "BAD_FINISH"


def closed_loop(
    addr: str, concurrency: int, duration_s: float, max_tokens: int
) -> dict[str, object]:
    """concurrency clients, each sending its next request when the last one ended."""
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    stop_at = time.monotonic() + duration_s

    def client(index: int) -> None:
        with grpc.insecure_channel(addr) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            i = 0
            while time.monotonic() < stop_at:
                prompt = [1 + (index * 31 + i) % 190 for _ in range(32)]
                result = one_call(stub, prompt, max_tokens)
                with lock:
                    outcomes[result] += 1
                if result == "RESOURCE_EXHAUSTED":
                    time.sleep(0.05)  # a polite client honours the retry hint (shortened here)
                i += 1

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client, range(concurrency)))
    wall_s = time.monotonic() - start
    return {
        "concurrency": concurrency,
        "wall_s": round(wall_s, 1),
        "served_per_s": round(outcomes["OK"] / wall_s, 2),
        "outcomes": dict(outcomes),
    }


def healthy(addr: str) -> bool:
    with grpc.insecure_channel(addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=API_HEALTH_NAME), timeout=1
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def kill_stage(
    cluster: LocalCluster, stage: int, num_streams: int, max_tokens: int
) -> dict[str, object]:
    prompts = [[5 + i, 17, 33, 80, 101, 7, 9 + i] for i in range(num_streams)]

    def stream(prompt: list[int]) -> list[int]:
        with grpc.insecure_channel(cluster.addr) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            request = generate_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True
            )
            return [t for r in stub.Generate(request, timeout=300) for t in r.token_ids]

    with concurrent.futures.ThreadPoolExecutor(num_streams) as pool:
        undisturbed = list(pool.map(stream, prompts))
        futures = [pool.submit(stream, p) for p in prompts]
        time.sleep(1.0)
        worker = dict(cluster.procs)[f"stage{stage}-rank0"]
        killed_at = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)
        while healthy(cluster.addr):
            time.sleep(0.02)
        detect_s = time.monotonic() - killed_at
        while not healthy(cluster.addr):
            cluster.supervise()
            time.sleep(0.05)
        recover_s = time.monotonic() - killed_at
        streams = []
        for future in futures:
            try:
                streams.append(future.result(timeout=300))
            except grpc.RpcError:
                streams.append([])
    lost = sum(1 for got, want in zip(streams, undisturbed, strict=True) if got != want)
    return {
        "streams": num_streams,
        "detect_s": round(detect_s, 2),
        "recover_s": round(recover_s, 2),
        "requests_lost_or_different": lost,
    }


def main() -> int:
    """Each phase in turn on one cluster; the report so far on stderr before the soak (it can
    run for an hour), the whole report as JSON on stdout at the end."""
    args = parse_args()
    with LocalCluster(cluster_config(args)) as cluster:
        report = load_overload_and_kill(cluster, args)
        print(json.dumps(report), file=sys.stderr, flush=True)
        if args.soak > 0:
            report.update(soak(cluster, args))
    print(json.dumps(report, indent=2))
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sarathictl.bench.reliability", description=__doc__)
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--concurrency", type=int, default=8, help="clients of the steady load")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per load phase")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request")
    p.add_argument("--max-queued", type=int, default=16, help="admission queue bound")
    p.add_argument("--soak", type=float, default=0.0, help="soak seconds (0: no soak)")
    p.add_argument(
        "--memory-trace-dir",
        default="",
        help="the controller's --memory-trace-dir: tracemalloc reports every minute (empty: off)",
    )
    p.add_argument(
        "--memory-trace-interval", type=float, default=60.0, help="seconds between those reports"
    )
    p.add_argument(
        "--memory-trace-frames",
        type=int,
        default=4,
        help="the controller's --memory-trace-frames (0: RSS and malloc only, no tracemalloc)",
    )
    return p.parse_args()


def cluster_config(args: argparse.Namespace) -> LocalClusterConfig:
    """The cluster under test: a 256-token budget, 64 MiB of KV cache, an admission queue of
    --max-queued requests (the bound the 10x load meets, with refusals) and, with
    --memory-trace-dir, the controller's memory tracing."""
    trace_args: tuple[str, ...] = ()
    if args.memory_trace_dir:
        trace_args = ("--memory-trace-dir", args.memory_trace_dir,
                      "--memory-trace-interval", str(args.memory_trace_interval),
                      "--memory-trace-frames", str(args.memory_trace_frames))  # fmt: skip
    return LocalClusterConfig(
        model_dir=args.model, pp=args.pp, port=0, budget_tokens=256, kv_cache_bytes=64 << 20,
        extra_controller_args=("--max-queued-requests", str(args.max_queued), *trace_args),
    )  # fmt: skip


def load_overload_and_kill(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, object]:
    """The steady load, 10x that load, and stage 1 killed mid-stream, with the controller's RSS
    in MiB before and after the overload."""
    controller_pid = dict(cluster.procs)["controller"].pid
    report: dict[str, object] = {}
    report["rss_start_mib"] = round(rss_mib(controller_pid), 1)
    report["steady"] = closed_loop(cluster.addr, args.concurrency, args.duration, args.max_tokens)
    report["overload_10x"] = closed_loop(
        cluster.addr, 10 * args.concurrency, args.duration, args.max_tokens
    )
    report["rss_after_overload_mib"] = round(rss_mib(controller_pid), 1)
    report["kill_stage_1"] = kill_stage(cluster, 1, 4, 64)
    return report


def soak(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, object]:
    """Whole minutes of closed-loop load at 80% of the steady phase's clients (just under what
    was held), the controller's RSS in MiB sampled after each."""
    clients = max(1, int(0.8 * args.concurrency))
    samples, minutes = [], []
    for minute in range(max(1, int(args.soak // 60))):
        minutes.append(closed_loop(cluster.addr, clients, 60.0, args.max_tokens))
        # The pid looked up again rather than reused: cluster.supervise() during the stage kill
        # restarts whatever exited, the controller included.
        samples.append(round(rss_mib(dict(cluster.procs)["controller"].pid), 1))
        # As it goes, so a long soak shows its trend (and keeps it if cut short).
        print(f"soak minute {minute + 1}: {minutes[-1]}, rss {samples[-1]} MiB",
              file=sys.stderr, flush=True)  # fmt: skip
    return {
        "soak_clients": clients,
        "soak_per_minute": minutes,
        "soak_rss_mib_per_minute": samples,
    }


if __name__ == "__main__":
    raise SystemExit(main())
