"""`sarathictl bench stage`: one stage's step time against the tokens in the step.

Decode batches (1..64 sequences, one token each, over an existing context), prefill chunks
(32..1024 tokens) and, with --later-chunks, chunks after cached positions of their own prompt
through the whole model as one stage (PP=1, TP=1), the paper's Figures 3, 5
and 7 in small. Against two ceilings measured in the same run:
- the decode floor: a decode step must read every weight once, so it cannot beat weight bytes /
  memory bandwidth; the bandwidth is measured with a large tensor copy;
- the prefill ceiling: a prompt token costs 2 FLOPs per linear weight, so tokens/s cannot beat
  the rate of a large matrix product in the model's dtype / those FLOPs.
On CUDA each decode point is timed eagerly and replayed from a CUDA graph (cuda_graphs.py); on
the CPU each point's step is also split into linear layers, attention and the rest, as a
worker's step log splits it.
`--random-shape` draws random weights of a known shape on the device (no download); with
`--model` as well it writes them there as a checkpoint first, and loads that.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from controller.scheduler.step_cost import attended
from controller.simulator.step_cost_fit import nonnegative_fit
from sarathictl.bench.random_model import shape_config, write_random_llama
from sarathictl.bench.stage_step_cmd import DECODE_BATCHES, PREFILL_CHUNKS
from stage_worker import bf16_layouts
from stage_worker.attention import SeqSlice, cpu_kernel, make_backend
from stage_worker.attention.base import AttentionBackend, build_metadata
from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ModelSpec, ShardSpec, load_spec, spec_from_config
from stage_worker.cuda_graphs import DecodeGraphs
from stage_worker.kv_cache import KVCache
from stage_worker.layers import ShardedLinear, cpu_matmul, fused, gemv
from stage_worker.layers.linear import CLOCK as LINEAR_CLOCK
from stage_worker.models import DTYPES, StageModel, build_stage, llama_cpu_loop
from stage_worker.models.llama import LlamaStage
from stage_worker.step_timer import TimedAttention

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16


def random_stage(spec: ModelSpec, device: str, dtype: torch.dtype, seed: int = 0) -> StageModel:
    """The whole model as one stage, its weights drawn on the device: N(0, 0.02) matrices, norm
    weights 1 and biases 0 (seconds for a 7B model on a GPU, where writing a checkpoint first
    would take minutes)."""
    model = build_stage(
        spec, ShardSpec(pp=1, tp=1, stage=0, tp_rank=0), TPGroup(), device, dtype, None
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02, generator=gen)
            else:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
        if spec.tie_word_embeddings and model.embed is not None and model.lm_head is not None:
            model.lm_head.weight = model.embed.weight  # one matrix, as a tied checkpoint loads
    model.pack()
    return model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of fn in milliseconds."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_bandwidth_bytes_per_s(device: str, num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Memory bandwidth of a large copy: it reads and writes num_bytes each."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * num_bytes / (ms / 1e3)


def matmul_flops_per_s(device: str, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """Rate of a [size, size] x [size, size] product on random data (zeros can run faster)."""
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(size, size, device=device, generator=gen).to(dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype)
    ms = time_ms(lambda: a @ b, device, repeats)
    return 2 * size**3 / (ms / 1e3)


def linear_flops_per_token(model: StageModel) -> int:
    """2 FLOPs per weight of every linear layer a prompt token passes (the LM head runs once per
    chunk, not per token, and attention's share is small at these lengths)."""
    return 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, ShardedLinear))


@dataclass(frozen=True)
class Row:
    kind: str
    """decode (tokens = sequences, one token each), prefill (a prompt's first chunk; tokens =
    chunk length) or chunk (tokens = chunk length, after the bench's context_tokens cached)."""
    tokens: int
    step_ms: float
    """Eager step time."""
    graph_ms: float | None = None
    """The same decode step replayed from a CUDA graph (None: not measured)."""
    linear_ms: float | None = None
    """On the CPU: the linear layers' share of a step (median of timed runs apart from step_ms's,
    as the worker's step log splits it: layers/linear.py's clock); None on CUDA, where the host
    clocks time launches, not kernels."""
    attention_ms: float | None = None
    """On the CPU: attention's share (KV write and kernel, step_timer.TimedAttention), likewise."""


class StageBench:
    def __init__(
        self,
        model: StageModel,
        context_tokens: int,
        attention: str,
        max_batch: int = max(DECODE_BATCHES),
        max_chunk: int = max(PREFILL_CHUNKS),
        max_later_chunk: int = 0,
    ) -> None:
        self.model = model
        self.context_tokens = context_tokens
        spec = model.spec
        blocks_per_seq = -(-(context_tokens + 1) // BLOCK_SIZE)
        num_blocks = max(
            max_batch * blocks_per_seq,
            -(-max_chunk // BLOCK_SIZE),
            -(-(context_tokens + max_later_chunk) // BLOCK_SIZE),
        )
        self.cache = KVCache(
            len(model.layers), num_blocks, BLOCK_SIZE, model.num_kv_heads_local, spec.head_dim,
            model.device, model.dtype,
        )  # fmt: skip
        self.blocks_per_seq = blocks_per_seq
        self.attention_name = attention
        backend = make_backend(attention, model.device)
        self.timed_attention = TimedAttention(backend) if model.device == "cpu" else None
        """The CPU's backend, timed as a worker times it (split_ms); None on CUDA."""
        self.attention: AttentionBackend = self.timed_attention or backend
        self.use_graphs = False
        """Replay decode steps from CUDA graphs (captured on first use)."""
        self._graphs: DecodeGraphs | None = None

    @torch.inference_mode()
    def step(self, seqs: list[SeqSlice]) -> None:
        """One last-stage step: forward over all tokens, logits at each chunk's last token."""
        meta = build_metadata(seqs, BLOCK_SIZE, self.model.device)
        num_tokens = meta.num_tokens
        ids = torch.randint(0, self.model.spec.vocab_size, (num_tokens,), device=self.model.device)
        hidden = None
        if self.use_graphs:
            self._graphs = self._graphs or DecodeGraphs(self.model, self.cache, self.attention_name)
            hidden = self._graphs.run(meta, ids)
        if hidden is None:
            hidden = self.model(ids, meta, self.cache, self.attention)
        rows = torch.tensor([s.query_start + s.num_tokens - 1 for s in seqs], device=hidden.device)
        self.model.compute_logits(hidden.index_select(0, rows)).argmax(-1)

    def decode_seqs(self, batch: int) -> list[SeqSlice]:
        per = self.blocks_per_seq
        return [
            SeqSlice(i, 1, self.context_tokens + 1, tuple(range(i * per, (i + 1) * per)))
            for i in range(batch)
        ]

    def prefill_seqs(self, chunk: int) -> list[SeqSlice]:
        return [SeqSlice(0, chunk, chunk, tuple(range(-(-chunk // BLOCK_SIZE))))]

    def later_chunk_seqs(self, chunk: int) -> list[SeqSlice]:
        """A chunk at positions context_tokens.. of its prompt, attending to all before it."""
        length = self.context_tokens + chunk
        return [SeqSlice(0, chunk, length, tuple(range(-(-length // BLOCK_SIZE))))]


def split_ms(bench: StageBench, step: Callable[[], object], repeats: int) -> tuple[float, float]:
    """CPU: the median linear and attention ms of `repeats` runs of step (runs of their own:
    step_ms is timed with the linear layers' clock off; the attention's, two clock readings a
    layer, always runs on the CPU)."""
    timed = bench.timed_attention
    assert timed is not None, "split_ms times a CPU stage"
    linear, attention = [], []
    LINEAR_CLOCK.on = True
    try:
        for _ in range(repeats):
            linear_s, attention_s = LINEAR_CLOCK.seconds, timed.seconds
            step()
            linear.append(LINEAR_CLOCK.seconds - linear_s)
            attention.append(timed.seconds - attention_s)
    finally:
        LINEAR_CLOCK.on = False
    return statistics.median(linear) * 1e3, statistics.median(attention) * 1e3


def load_model(args: argparse.Namespace, dtype: torch.dtype) -> tuple[StageModel, str]:
    """The model to time and its name: random weights drawn on the device (--random-shape
    alone), or a checkpoint (--model; with --random-shape written there first if missing)."""
    shard = ShardSpec(pp=1, tp=1, stage=0, tp_rank=0)
    if args.model is None:
        spec = spec_from_config(shape_config(args.random_shape))
        # the bf16 weights' layouts as a worker would choose them (CPU bf16; else nothing)
        bf16_layouts.choose(spec, shard, TPGroup(), args.device, dtype, 0, 1)
        return random_stage(spec, args.device, dtype), f"random {args.random_shape}"
    model_dir = Path(args.model)
    if args.random_shape and not (model_dir / "config.json").exists():
        logger.info("writing a random %s checkpoint to %s", args.random_shape, model_dir)
        write_random_llama(model_dir, args.random_shape, dtype)
    spec = load_spec(model_dir)
    bf16_layouts.choose(spec, shard, TPGroup(), args.device, dtype, 0, 1)
    reader = CheckpointReader(model_dir)
    model = build_stage(spec, shard, TPGroup(), args.device, dtype, reader)
    reader.close()
    return model, model_dir.name


def time_points(bench: StageBench, args: argparse.Namespace) -> tuple[list[Row], float]:
    """Every decode, prefill and later-chunk point, and the copy bandwidth (measured after the
    first)."""
    rows: list[Row] = []
    bandwidth = 0.0
    with_graphs = args.cuda_graphs and args.device.startswith("cuda")
    for kind, sizes, make in (
        ("decode", args.decode_batches, bench.decode_seqs),
        ("prefill", args.prefill_chunks, bench.prefill_seqs),
        ("chunk", args.later_chunks, bench.later_chunk_seqs),
    ):
        for n in sizes:
            step = partial(bench.step, make(n))
            ms = time_ms(step, args.device, args.repeats)
            graph_ms = None
            if kind == "decode" and with_graphs:
                bench.use_graphs = True
                graph_ms = time_ms(step, args.device, args.repeats)
                bench.use_graphs = False
            linear_ms = attention_ms = None
            if bench.timed_attention is not None:
                linear_ms, attention_ms = split_ms(bench, step, args.repeats)
            rows.append(Row(kind, n, ms, graph_ms, linear_ms, attention_ms))
            if len(rows) == 1:
                # The copy right after the first point, with the same thread count: on a shared
                # machine the floor and the step it is compared with then see the same load.
                bandwidth = copy_bandwidth_bytes_per_s(args.device, args.copy_bytes)
    return rows, bandwidth


@dataclass(frozen=True)
class Report:
    model: str
    dtype: str
    device: str
    device_name: str
    attention: str
    small_batch_kernel: bool
    fused_ops: bool
    """The fused kernels (layers/fused.py) ran the elementwise ops."""
    decode_kernel: bool
    """Graph-replayed decodes with torch attention attended with the Triton kernel
    (attention/triton_decode.py)."""
    decode_splits: int
    """Ways the decode kernel split each context (0: its rule by context length)."""
    cpu_attention_kernel: bool
    """CPU attention ran on the C kernel (cpu_kernel.py)."""
    cpu_matmul_kernel: bool
    """The float32 linear layers ran the package's AVX2 matmul kernel (cpu_matmul.py)."""
    cpu_layer_loop: bool
    """The layers ran as one loop over the C kernels (models/llama_cpu_loop.py)."""
    threads: int
    context_tokens: int
    param_bytes: int
    copy_bandwidth_gb_s: float
    decode_floor_ms: float
    """Weight bytes / copy bandwidth: no decode step can be faster."""
    matmul_tflop_s: float | None
    prefill_ceiling_tokens_s: float | None
    """Matmul rate / linear FLOPs per token: no prefill can be faster."""
    rows: list[Row]
    step_cost: tuple[float, float, float] | None = None
    """The scheduler's StepCostModel fitted to the rows (fixed, per token, per attended pair),
    for `--step-cost` of the controller and `sarathictl up` (whole model as one stage)."""

    @property
    def decode1_over_floor(self) -> float | None:
        first = next((r for r in self.rows if r.kind == "decode"), None)
        return None if first is None else first.step_ms / self.decode_floor_ms

    @property
    def decode1_graph_over_floor(self) -> float | None:
        first = next((r for r in self.rows if r.kind == "decode"), None)
        if first is None or first.graph_ms is None:
            return None
        return first.graph_ms / self.decode_floor_ms

    def as_json(self) -> dict[str, object]:
        out = asdict(self)
        out["decode1_over_floor"] = self.decode1_over_floor
        out["decode1_graph_over_floor"] = self.decode1_graph_over_floor
        return out


def make_report(
    args: argparse.Namespace, model: StageModel, name: str, rows: list[Row], bandwidth: float
) -> Report:
    rate = None
    if any(r.kind != "decode" for r in rows):
        rate = matmul_flops_per_s(args.device, model.dtype, args.matmul_size)
    cuda = args.device.startswith("cuda")
    return Report(
        model=name,
        dtype=args.dtype,
        device=args.device,
        device_name=torch.cuda.get_device_name(args.device) if cuda else "cpu",
        attention=args.attention,
        small_batch_kernel=args.small_batch_kernel,
        fused_ops=fused.kernels_for(torch.empty(0, dtype=model.dtype, device=args.device))
        is not None,
        decode_kernel=args.attention == "torch"
        and fused.decode_attention_kernel(args.device) is not None,
        decode_splits=args.decode_splits,
        cpu_attention_kernel=not cuda
        and cpu_kernel.available()
        and cpu_kernel.takes_dtype(model.dtype),
        cpu_matmul_kernel=any(
            m.f32 is not None for m in model.modules() if isinstance(m, ShardedLinear)
        ),
        cpu_layer_loop=isinstance(model, LlamaStage) and model.layer_loop is not None,
        threads=torch.get_num_threads(),
        context_tokens=args.context_tokens,
        param_bytes=model.param_bytes,
        copy_bandwidth_gb_s=bandwidth / 1e9,
        decode_floor_ms=model.param_bytes / bandwidth * 1e3,
        matmul_tflop_s=None if rate is None else rate / 1e12,
        prefill_ceiling_tokens_s=None if rate is None else rate / linear_flops_per_token(model),
        rows=rows,
        step_cost=fit_step_cost(rows, args.context_tokens),
    )


def fit_step_cost(rows: list[Row], context_tokens: int) -> tuple[float, float, float] | None:
    """Least squares of each point's best time against (1, tokens, attended pairs): a decode of
    B sequences over c cached tokens attends B (c + 1) keys, a prefill of n tokens n (n + 1) / 2,
    a later chunk n c + n (n + 1) / 2. None without decodes and chunks both; a coefficient
    fitted negative is dropped."""
    if not ({"decode"} < {r.kind for r in rows}) or len(rows) < 3:
        return None
    features, times = [], []
    for r in rows:
        if r.kind == "decode":
            pairs = r.tokens * (context_tokens + 1)
        else:
            pairs = attended(context_tokens if r.kind == "chunk" else 0, r.tokens)
        features.append((1.0, float(r.tokens), float(pairs)))
        times.append(min(r.step_ms, r.graph_ms or r.step_ms) / 1e3)
    fixed, per_token, per_attended = nonnegative_fit(np.array(features), np.array(times))
    return fixed, max(per_token, 1e-9), per_attended


def print_report(r: Report) -> None:
    print(
        f"{r.model} ({r.dtype}): {r.param_bytes / 1e6:.1f} MB of weights as held, on "
        f"{r.device_name} ({r.threads} threads), decodes and later chunks over "
        f"{r.context_tokens}-token contexts, "
        f"attention={r.attention}{' (C kernel)' if r.cpu_attention_kernel else ''}"
        f"{' (Triton decode kernel in graphs)' if r.decode_kernel else ''}"
        f"{', linear layers on the AVX2 matmul kernel' if r.cpu_matmul_kernel else ''}"
        f"{', layers as one loop over the C kernels' if r.cpu_layer_loop else ''}\n"
    )
    print(
        "| step | tokens | step ms | CUDA graph ms | linear / attention / rest ms | tokens/s "
        "| against the limit |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in r.rows:
        best_ms = min(row.step_ms, row.graph_ms or row.step_ms)
        graph = "-" if row.graph_ms is None else f"{row.graph_ms:.2f}"
        split = "-"
        if row.linear_ms is not None and row.attention_ms is not None:
            rest_ms = row.step_ms - row.linear_ms - row.attention_ms
            split = f"{row.linear_ms:.1f} / {row.attention_ms:.1f} / {rest_ms:.1f}"
        tokens_s = row.tokens / (best_ms / 1e3)
        if row.kind == "decode":
            limit = f"{best_ms / r.decode_floor_ms:.2f}x the floor"
        else:
            assert r.prefill_ceiling_tokens_s is not None
            limit = f"{tokens_s / r.prefill_ceiling_tokens_s:.0%} of the ceiling"
        cells = [row.kind, str(row.tokens), f"{row.step_ms:.2f}", graph, split]
        cells += [f"{tokens_s:,.0f}", limit]
        print("| " + " | ".join(cells) + " |")
    print(
        f"\ncopy bandwidth {r.copy_bandwidth_gb_s:.1f} GB/s; decode floor "
        f"{r.decode_floor_ms:.2f} ms (weight bytes / bandwidth)"
    )
    if r.prefill_ceiling_tokens_s is not None:
        print(
            f"matmul {r.matmul_tflop_s:.1f} TFLOP/s; prefill ceiling "
            f"{r.prefill_ceiling_tokens_s:,.0f} tokens/s (matmul rate / linear FLOPs per token)"
        )
    if r.step_cost is not None:
        fixed, per_token, per_attended = r.step_cost
        print(
            f"step cost fit (whole model as one stage; a stage of a PP-stage pipeline costs "
            f"about 1/PP of it): --step-cost {fixed:.3g},{per_token:.3g},{per_attended:.3g}"
        )


def run(args: argparse.Namespace) -> int:
    if not (args.decode_batches or args.prefill_chunks or args.later_chunks):
        raise ValueError(
            "--decode-batches, --prefill-chunks and --later-chunks are all empty: nothing to time"
        )
    if args.model is None and args.random_shape is None:
        raise ValueError("give --model (a checkpoint folder), --random-shape, or both")
    if args.matmul_size is None:
        args.matmul_size = 8192 if args.device.startswith("cuda") else 1024
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.small_batch_kernel:
        gemv.enable()
    cpu_kernel.set_enabled(args.cpu_attention_kernel)
    fused.set_enabled(args.fused_ops)
    fused.set_decode_kernel_enabled(args.decode_kernel)
    decode_kernel = fused.decode_attention_kernel(args.device)  # None where switched off
    if decode_kernel is not None:
        decode_kernel.force_splits(args.decode_splits)
    elif args.decode_splits:
        raise ValueError("--decode-splits needs the decode kernel (CUDA, Triton, --decode-kernel)")
    cpu_matmul.set_enabled(args.cpu_matmul_kernel)
    llama_cpu_loop.set_enabled(args.cpu_layer_loop)
    model, name = load_model(args, DTYPES[args.dtype])
    bench = StageBench(
        model,
        args.context_tokens,
        args.attention,
        max(args.decode_batches, default=1),
        max(args.prefill_chunks, default=1),
        max(args.later_chunks, default=0),
    )
    rows, bandwidth = time_points(bench, args)
    report = make_report(args, model, name, rows, bandwidth)
    if args.json:
        print(json.dumps(report.as_json(), indent=1))
    else:
        print_report(report)
    return 0
