"""One run of vLLM's client, `vllm bench serve`, against whichever server is up."""

from __future__ import annotations

import math
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench_vs_vllm.servers import child_env


@dataclass(frozen=True)
class Workload:
    name: str
    dataset_args: list[str]
    """The --dataset-name and its options."""
    num_prompts: int = 0
    """Requests per run when the dataset fixes them (multi-turn chats); 0: --num-prompts."""


def random_workload(input_len: int, output_len: int) -> Workload:
    return Workload(
        f"random-{input_len}-{output_len}",
        [
            "--dataset-name", "random",
            "--random-input-len", str(input_len),
            "--random-output-len", str(output_len),
        ],
    )  # fmt: skip


def prefix_workload(
    prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int
) -> Workload:
    """vLLM's prefix_repetition dataset: every prompt one of `num_prefixes` shared prefixes and a
    suffix of its own, as a chat product's system prompts are."""
    return Workload(
        f"prefix-{num_prefixes}x{prefix_len}-{suffix_len}-{output_len}",
        [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(prefix_len),
            "--prefix-repetition-suffix-len", str(suffix_len),
            "--prefix-repetition-num-prefixes", str(num_prefixes),
            "--prefix-repetition-output-len", str(output_len),
        ],
    )  # fmt: skip


def trace_workload(name: str, jsonl: Path, num_prompts: int = 0) -> Workload:
    """The trace's lengths, in its order; arrivals drawn at the asked rate, not the trace's own."""
    return Workload(
        name,
        ["--dataset-name", "timed_trace", "--dataset-path", str(jsonl), "--no-self-timed"],
        num_prompts,
    )


def rate_flag(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def bench_command(
    vllm_bin: Path,
    base_url: str,
    model_name: str,
    tokenizer: Path,
    workload: Workload,
    rate: float,
    num_prompts: int,
    seed: int,
    result: Path | None,
) -> list[str]:
    """Every request with ignore_eos, so each generates exactly its asked output length on both
    servers; percentiles 50 and 99 of TTFT, TPOT and ITL; the result saved where asked, with
    each request's start and latency (--save-detailed: the bubbles need them)."""
    command = [
        str(vllm_bin), "bench", "serve",
        "--backend", "openai",
        "--base-url", base_url,
        "--model", model_name,
        "--tokenizer", str(tokenizer),
        *workload.dataset_args,
        "--num-prompts", str(num_prompts),
        "--request-rate", rate_flag(rate),
        "--seed", str(seed),
        "--ignore-eos",
        "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
    ]  # fmt: skip
    if result is not None:
        command += [
            "--save-result",
            "--save-detailed",
            "--result-dir", str(result.parent),
            "--result-filename", result.name,
        ]  # fmt: skip
    return command


class BenchError(RuntimeError):
    """`vllm bench serve` failed; the message names its log."""


def run_bench(command: list[str], log_path: Path, env: dict[str, str]) -> float:
    """Runs it with its output in `log_path`; returns its wall seconds."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=child_env(env))
    if code != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise BenchError(
            f"vllm bench serve exited with code {code}; see {log_path}:\n  " + "\n  ".join(tail)
        )
    return time.monotonic() - started
