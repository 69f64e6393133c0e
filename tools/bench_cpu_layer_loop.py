"""A CPU stage's step with its layers as module calls against the layer loop
(stage_worker/models/llama_cpu_loop.py), alternated in one process.

    PYTHONPATH=tools:. python tools/bench_cpu_layer_loop.py [--model demo] [--decodes 1,4,16]
        [--prefills 64,128] [--rounds 6] [--dtype float32|bfloat16]

A step is what the last stage of a worker computes: embedding, every layer, the final norm and
the LM head of each sequence's last token. The two paths alternate in rounds (modules first in
even rounds, the loop first in odd ones) so that a machine whose speed drifts loads both alike;
each round's figure is the median of its calls, and the table gives the median of the rounds.
Each point is first checked bit for bit (hidden states and KV cache) between the two paths.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from sarathictl.argtypes import comma_list, int_at_least
from sarathictl.bench.stage_step import StageBench
from sarathictl.commands.up import resolve_model

from stage_worker import bf16_layouts
from stage_worker.attention import SeqSlice
from stage_worker.attention.base import build_metadata
from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ShardSpec, load_spec
from stage_worker.models import build_stage
from stage_worker.models.llama import LlamaStage


def step_runner(model: LlamaStage, bench: StageBench) -> Callable[[list[SeqSlice], bool], None]:
    loop = model.layer_loop

    def run(seqs: list[SeqSlice], looped: bool) -> None:
        model.layer_loop = loop if looped else None
        meta = build_metadata(seqs, bench.cache.block_size, "cpu")
        ids = torch.arange(meta.num_tokens) % model.spec.vocab_size
        hidden = model(ids, meta, bench.cache, bench.attention)  # [T, H]
        rows = torch.tensor([s.query_start + s.num_tokens - 1 for s in seqs])
        model.compute_logits(hidden.index_select(0, rows))

    return run


def same_both_ways(model: LlamaStage, bench: StageBench, seqs: list[SeqSlice]) -> bool:
    loop, outputs = model.layer_loop, []
    for looped in (False, True):
        model.layer_loop = loop if looped else None
        bench.cache.data.zero_()
        meta = build_metadata(seqs, bench.cache.block_size, "cpu")
        hidden = model(torch.arange(meta.num_tokens), meta, bench.cache, bench.attention)
        outputs.append((hidden, bench.cache.data.clone()))
    model.layer_loop = loop
    (h0, kv0), (h1, kv1) = outputs
    return torch.equal(h0, h1) and torch.equal(kv0, kv1)


def time_point(
    run: Callable[[list[SeqSlice], bool], None], seqs: list[SeqSlice], rounds: int
) -> dict[bool, list[float]]:
    """The median ms of each round, keyed by whether the loop ran."""
    calls = max(3, 48 // sum(s.num_tokens for s in seqs))
    per_round: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for looped in (False, True) if r % 2 == 0 else (True, False):
            run(seqs, looped)  # warm: the first call after a switch allocates anew
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                run(seqs, looped)
                times.append(time.perf_counter() - start)
            per_round[looped].append(statistics.median(times) * 1e3)
    return per_round


def each_round(times: dict[bool, list[float]]) -> str:
    """Each round's modules/loop ms, to show the machine's drift beside the medians."""
    return " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(times[False], times[True], strict=True))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help="model folder, or `demo` (SmolLM2-135M)")
    positive = int_at_least(1)
    p.add_argument("--decodes", type=comma_list(positive), default=(1, 4, 16, 32))
    p.add_argument("--prefills", type=comma_list(positive), default=(64, 128))
    p.add_argument("--context-tokens", type=positive, default=256, help="each decode's context")
    p.add_argument("--rounds", type=positive, default=6)
    p.add_argument("--threads", type=int_at_least(0), default=0, help="0: torch's default")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    shard = ShardSpec(pp=1, tp=1, stage=0, tp_rank=0)
    dtype = getattr(torch, args.dtype)
    spec = load_spec(model_dir)
    # bf16: the weights' layouts as a worker chooses them (stage_worker/bf16_layouts.py)
    bf16_layouts.choose(spec, shard, TPGroup(), "cpu", dtype, 0, 1)
    reader = CheckpointReader(model_dir)
    model = build_stage(spec, shard, TPGroup(), "cpu", dtype, reader)
    reader.close()
    if not isinstance(model, LlamaStage) or model.layer_loop is None:
        print(
            "the layer loop does not apply here (a Llama model, x86-64 with AVX2 + FMA; "
            "bf16: AVX-512 with bf16)"
        )
        return 1
    chunk = max((*args.prefills, 1))
    bench = StageBench(model, args.context_tokens, "torch", max((*args.decodes, 1)), chunk)
    run = step_runner(model, bench)
    threads = torch.get_num_threads()
    print(f"{args.dtype}, {threads} threads, decodes over {args.context_tokens} tokens\n")
    print("| step | tokens | same bits | modules ms | loop ms | modules / loop | each round |")
    print("|---|---:|---|---:|---:|---:|---|")
    points = [("decode", n, bench.decode_seqs(n)) for n in args.decodes]
    points += [("prefill", n, bench.prefill_seqs(n)) for n in args.prefills]
    with torch.inference_mode():
        for kind, n, seqs in points:
            same = same_both_ways(model, bench, seqs)
            times = time_point(run, seqs, args.rounds)
            modules, looped = statistics.median(times[False]), statistics.median(times[True])
            print(
                f"| {kind} | {n} | {'yes' if same else 'NO'} | {modules:.1f} | {looped:.1f} "
                f"| {modules / looped:.2f}x | {each_round(times)} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
