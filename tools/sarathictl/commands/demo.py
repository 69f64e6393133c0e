"""`sarathictl demo` (`make demo`): a real model answering through a real two-stage pipeline."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from sarathi_proto import generate_pb2

from sarathictl.argtypes import int_at_least
from sarathictl.client import Client
from sarathictl.commands.status import render
from sarathictl.commands.up import add_cluster_flags, cluster_config
from sarathictl.local_cluster import LocalCluster

if TYPE_CHECKING:
    from rich.console import Console

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about pipelines.",
    "Explain in two sentences why chunked prefills keep decodes fast.",
    "List three uses of a hash map.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What does a compiler do?",
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="start a local PP=2 cluster, stream a few answers, stop")
    add_cluster_flags(p)
    p.add_argument("--max-tokens", type=int_at_least(1), default=96, help="tokens per answer")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    console.rule("sarathi-cluster demo")
    console.print(f"model: {args.model}; preparing it if needed (cached after the first run)")
    config = cluster_config(args, port=0, http_port=0)  # 0: free ports; the HTTP API is on
    console.print(
        f"starting a local cluster: controller + {config.pp} stages x {config.tp} TP ranks, "
        f"policy {config.policy}, budget {config.budget_tokens} tokens"
    )
    started = time.monotonic()
    with LocalCluster(config) as cluster:
        console.print(f"serving on {cluster.addr} after {time.monotonic() - started:.1f} s\n")
        with Client(cluster.addr) as client:
            console.print(
                f"sending {len(PROMPTS)} prompts at once: they share every micro-batch (new "
                "prompts' chunks beside the others' decodes); the first streams here, the others "
                "print after it\n"
            )
            with ThreadPoolExecutor(len(PROMPTS) - 1) as pool:
                others = [pool.submit(collect, client, p, args.max_tokens) for p in PROMPTS[1:]]
                stream_one(console, client, PROMPTS[0], args.max_tokens)
                for prompt, future in zip(PROMPTS[1:], others, strict=True):
                    show_answer(console, prompt, future)
            openai_answer(console, cluster.http_base_url, args.max_tokens)
            console.print(render(client.status()))
    console.print("cluster stopped; every process has exited")
    return 0


def _request(prompt: str, max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, apply_chat_template=True
    )


def _stats(last: generate_pb2.GenerateResponse) -> str:
    return (
        f"[dim]({last.num_output_tokens} tokens, TTFT {last.ttft_s * 1e3:.0f} ms, "
        f"mean TBT {last.mean_tbt_s * 1e3:.1f} ms)[/dim]\n"
    )


def stream_one(console: Console, client: Client, prompt: str, max_tokens: int) -> None:
    """One answer token by token, as a chat client shows it."""
    console.print(f"[bold]user>[/bold] {prompt}")
    sys.stdout.write("assistant> ")
    last = None
    for response in client.generate(_request(prompt, max_tokens), timeout_s=300):
        sys.stdout.write(response.text)
        sys.stdout.flush()
        last = response
    assert last is not None
    console.print("\n" + _stats(last))


def collect(
    client: Client, prompt: str, max_tokens: int
) -> tuple[str, generate_pb2.GenerateResponse]:
    """One whole answer, with its last message (the request's TTFT and mean TBT)."""
    responses = list(client.generate(_request(prompt, max_tokens), timeout_s=300))
    return "".join(r.text for r in responses), responses[-1]


def show_answer(
    console: Console, prompt: str, answer: Future[tuple[str, generate_pb2.GenerateResponse]]
) -> None:
    text, last = answer.result()
    console.print(f"[bold]user>[/bold] {prompt}")
    console.print(f"assistant> {text}", markup=False, highlight=False)
    console.print(_stats(last))


def openai_answer(console: Console, base_url: str, max_tokens: int) -> None:
    """The same cluster through its OpenAI-compatible HTTP API, with the official client."""
    try:
        from openai import OpenAI
    except ImportError:  # a dev dependency: `pip install -e '.[dev]'` brings it
        console.print("[dim](install the `openai` package to see the HTTP API answer too)[/dim]")
        return
    for name in ("httpx", "httpx2"):  # the client logs every request at INFO: not for a demo
        logging.getLogger(name).setLevel(logging.WARNING)
    prompt = "Name one reason pipelines need many micro-batches."
    console.print(f"[bold]user (openai client, {base_url})>[/bold] {prompt}")
    client = OpenAI(base_url=base_url, api_key="unused", timeout=300)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    console.print(f"assistant> {reply.choices[0].message.content}")
    if reply.usage is not None:
        console.print(
            f"[dim]({reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} "
            f"completion tokens, finish reason {reply.choices[0].finish_reason})[/dim]\n"
        )
