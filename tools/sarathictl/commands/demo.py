"""`sarathictl demo` (`make demo`): a real model answering through a real two-stage pipeline."""

from __future__ import annotations

import argparse
import sys
import time

from sarathi_proto import generate_pb2

from sarathictl.client import Client
from sarathictl.commands.status import render
from sarathictl.commands.up import add_cluster_flags, cluster_config
from sarathictl.local_cluster import LocalCluster

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about pipelines.",
    "Explain in two sentences why chunked prefills keep decodes fast.",
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="start a local PP=2 cluster, stream a few answers, stop")
    add_cluster_flags(p)
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    console.rule("sarathi-cluster demo")
    console.print(f"model: {args.model}; preparing it if needed (cached after the first run)")
    config = cluster_config(args, port=0)
    console.print(
        f"starting a local cluster: controller + {config.pp} stages x {config.tp} TP ranks, "
        f"policy {config.policy}, budget {config.budget_tokens} tokens"
    )
    started = time.monotonic()
    with LocalCluster(config) as cluster:
        console.print(f"serving on {cluster.addr} after {time.monotonic() - started:.1f} s\n")
        with Client(cluster.addr) as client:
            for prompt in PROMPTS:
                console.print(f"[bold]user>[/bold] {prompt}")
                sys.stdout.write("assistant> ")
                request = generate_pb2.GenerateRequest(
                    prompt=prompt, max_tokens=args.max_tokens, apply_chat_template=True
                )
                last = None
                for response in client.generate(request, timeout_s=300):
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                    last = response
                assert last is not None
                console.print(
                    f"\n[dim]({last.num_output_tokens} tokens, TTFT {last.ttft_s * 1e3:.0f} ms, "
                    f"mean TBT {last.mean_tbt_s * 1e3:.1f} ms)[/dim]\n"
                )
            console.print(render(client.status()))
    console.print("cluster stopped; every process has exited")
    return 0
