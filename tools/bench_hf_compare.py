"""Side by side on this machine: our local pipeline against Hugging Face transformers, same
model, same prompts, same output lengths.

A dev-time benchmark (it imports transformers, a test/bench dependency only):

    .venv/bin/python tools/bench_hf_compare.py --model DIR --num-requests 32

Every request arrives at once (an offline batch), so both sides are judged on throughput and on
the P99 gap between tokens of one request. transformers runs its continuous batching where the
model's attention supports it (Llama does, Falcon does not), else one padded batched `generate`.
Ours runs PP=2 with one thread per stage worker; HF runs in one process with two threads: the
same two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sarathictl.bench.live_load import PROMPT_ID_LIMIT, replay, scale_requests
from sarathictl.bench.workloads import WorkloadSpec, make_requests
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig

from controller.executor.simulated import SimRequest


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def run_ours(
    model: str,
    requests: list[SimRequest],
    seed: int,
    budget: int,
    dtype: str = "float32",
    max_num_seqs: int = 0,
) -> dict[str, float]:
    config = LocalClusterConfig(
        model_dir=model,
        pp=2,
        port=0,
        budget_tokens=budget,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
    )
    with LocalCluster(config) as cluster:
        asyncio.run(replay(cluster.addr, requests[:2], seed=seed + 1))  # warm-up
        run = asyncio.run(replay(cluster.addr, requests, seed=seed))
    gaps = [g for r in run.records for g in r.gaps_s]
    tokens = sum(r.num_output_tokens for r in run.records)
    return {
        "output_tokens_per_s": tokens / (run.end_s - run.start_s),
        "tbt_p50_s": statistics.median(gaps),
        "tbt_p99_s": _p99(gaps),
        "wall_s": run.end_s - run.start_s,
        "errors": run.num_errors,
    }


def run_hf(
    model: str, requests: list[SimRequest], seed: int, dtype: str = "float32"
) -> dict[str, float | str]:
    """transformers' continuous batching (`generate_batch`) where the model's attention supports
    it, else one padded batched `generate`: what a user of this machine would run instead."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, PROMPT_ID_LIMIT, r.num_prompt_tokens).tolist() for r in requests]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    # One output length for all (generate_batch takes one config): the workload makes it so.
    max_new = requests[0].num_output_tokens
    timed = _hf_generate_batch(hf, prompts, max_new)
    mode = "generate_batch"
    if timed is None:
        timed, mode = _hf_batched_generate(hf, prompts, max_new), "generate (one padded batch)"
    wall, tokens, gaps = timed
    return {
        "mode": mode,
        "output_tokens_per_s": tokens / wall,
        "tbt_p50_s": statistics.median(gaps),
        "tbt_p99_s": _p99(gaps),
        "wall_s": wall,
        "errors": 0,
    }


Timed = tuple[float, int, list[float]]
"""Wall seconds, output tokens, every gap between two tokens of one request."""


def _hf_generate_batch(hf: Any, prompts: list[list[int]], max_new: int) -> Timed | None:
    """None when the model cannot run transformers' paged continuous batching (Falcon's
    attention, for one, does not take its paged cache)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1)
    hf.generate_batch(prompts[:2], generation_config=config, persistent_manager=True)  # warm-up
    start = time.perf_counter()
    out = hf.generate_batch(
        prompts, generation_config=config, record_timestamps=True, persistent_manager=True
    )
    wall = time.perf_counter() - start
    if len(out) < len(prompts) or any(len(o.generated_tokens) < max_new for o in out.values()):
        return None  # it logs the failed requests and returns them without tokens
    gaps = [b - a for o in out.values() for a, b in itertools.pairwise(o.timestamps)]
    return wall, sum(len(o.generated_tokens) for o in out.values()), gaps


def _hf_batched_generate(hf: Any, prompts: list[list[int]], max_new: int) -> Timed:
    """Every prompt left-padded into one batch; each decoding step's time is a gap of every
    request (they all get a token per step)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    longest = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])  # [batch, longest]
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {"max_new_tokens": max_new, "min_new_tokens": max_new, "do_sample": False,
              "pad_token_id": pad}  # fmt: skip
    with torch.inference_mode():
        hf.generate(
            ids[:2, -8:],
            attention_mask=mask[:2, -8:],
            **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2},
        )  # warm-up
        clock = StepClock()
        start = time.perf_counter()
        out = hf.generate(
            ids, attention_mask=mask, logits_processor=LogitsProcessorList([clock]), **kwargs
        )
        wall = time.perf_counter() - start
    steps = [b - a for a, b in itertools.pairwise(clock.times)]
    num_new = out.shape[1] - longest
    return wall, num_new * len(prompts), steps * len(prompts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--trace", default="splitwise")
    p.add_argument("--scale", type=float, default=0.25, help="prompt length scale")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides")
    p.add_argument("--max-num-seqs", type=int, default=0, help="ours (0: the controller default)")
    args = p.parse_args()
    spec = WorkloadSpec(source=args.trace, num_requests=args.num_requests, seed=args.seed)
    trace = scale_requests(make_requests(spec, 1.0), args.scale, 0)
    requests = [SimRequest(0.0, r.num_prompt_tokens, args.output_tokens) for r in trace]
    ours = run_ours(args.model, requests, args.seed, args.budget, args.dtype, args.max_num_seqs)
    hf = run_hf(args.model, requests, args.seed, args.dtype)
    print(json.dumps({"model": Path(args.model).name, "requests": len(requests),
                      "ours_pp2": ours, "hf": hf}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
