"""`sarathictl bench stage`: one stage's step time against the tokens in the step.

Decode batches (1..64 sequences, one token each, over an existing context) and prefill chunks
(32..1024 tokens) through the whole model as one stage (PP=1, TP=1), the paper's Figures 3, 5
and 7 in small. Also the decode memory floor: a decode step must read every weight once, so it
cannot beat weight bytes / memory bandwidth; the bandwidth is measured with a large tensor copy.
`--random-shape` writes a random-weight checkpoint of a known shape first (no download).
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

import torch

from sarathictl.argtypes import comma_list, device, int_at_least
from stage_worker.attention import SeqSlice, make_backend
from stage_worker.attention.base import build_metadata
from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ShardSpec, load_spec
from stage_worker.kv_cache import KVCache
from stage_worker.layers import gemv
from stage_worker.models import DTYPES, StageModel, build_stage

logger = logging.getLogger(__name__)

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_CHUNKS = (32, 64, 128, 256, 512, 1024)
BLOCK_SIZE = 16

# Llama-architecture shapes for --random-shape: config.json fields.
SHAPES: dict[str, dict[str, int | float | bool]] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True, rope_theta=10000.0,
    ),
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
    ),
    "mistral-7b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False, rope_theta=1e6,
    ),
}  # fmt: skip


def write_random_llama(model_dir: Path, shape: str, dtype: torch.dtype) -> None:
    """A Llama checkpoint with random weights: config.json + model.safetensors."""
    from safetensors.torch import save_file

    shape_cfg = SHAPES[shape]
    h, f = int(shape_cfg["hidden_size"]), int(shape_cfg["intermediate_size"])
    heads, kv = int(shape_cfg["num_attention_heads"]), int(shape_cfg["num_key_value_heads"])
    vocab, num_layers = int(shape_cfg["vocab_size"]), int(shape_cfg["num_hidden_layers"])
    tied = bool(shape_cfg["tie_word_embeddings"])
    d = h // heads
    cfg: dict[str, object] = dict(shape_cfg, architectures=["LlamaForCausalLM"])
    cfg.update(model_type="llama", rms_norm_eps=1e-5, hidden_act="silu")
    cfg.update(max_position_embeddings=8192)
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(vocab, h)}
    tensors["model.norm.weight"] = torch.ones(h, dtype=dtype)
    if not tied:
        tensors["lm_head.weight"] = rand(vocab, h)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * d, h),
            p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * d, h),
            p + "self_attn.o_proj.weight": rand(h, heads * d),
            p + "mlp.gate_proj.weight": rand(f, h),
            p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))


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


@dataclass(frozen=True)
class Row:
    kind: str
    """decode (tokens = sequences, one token each) or prefill (tokens = chunk length)."""
    tokens: int
    step_ms: float


class StageBench:
    def __init__(
        self,
        model: StageModel,
        context_tokens: int,
        attention: str,
        max_batch: int = max(DECODE_BATCHES),
        max_chunk: int = max(PREFILL_CHUNKS),
    ) -> None:
        self.model = model
        self.context_tokens = context_tokens
        spec = model.spec
        blocks_per_seq = -(-(context_tokens + 1) // BLOCK_SIZE)
        num_blocks = max(max_batch * blocks_per_seq, -(-max_chunk // BLOCK_SIZE))
        self.cache = KVCache(
            len(model.layers), num_blocks, BLOCK_SIZE, model.num_kv_heads_local, spec.head_dim,
            model.device, model.dtype,
        )  # fmt: skip
        self.blocks_per_seq = blocks_per_seq
        self.attention = make_backend(attention, model.device)

    @torch.inference_mode()
    def step(self, seqs: list[SeqSlice]) -> None:
        """One last-stage step: forward over all tokens, logits at each chunk's last token."""
        meta = build_metadata(seqs, BLOCK_SIZE, self.model.device)
        num_tokens = meta.num_tokens
        ids = torch.randint(0, self.model.spec.vocab_size, (num_tokens,), device=self.model.device)
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


def run(args: argparse.Namespace) -> int:
    if not args.decode_batches and not args.prefill_chunks:
        raise ValueError("--decode-batches and --prefill-chunks are both empty: nothing to time")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.small_batch_kernel:
        gemv.enable()
    dtype = DTYPES[args.dtype]
    model_dir = Path(args.model)
    if args.random_shape and not (model_dir / "config.json").exists():
        logger.info("writing a random %s checkpoint to %s", args.random_shape, model_dir)
        write_random_llama(model_dir, args.random_shape, dtype)
    spec = load_spec(model_dir)
    reader = CheckpointReader(model_dir)
    shard = ShardSpec(pp=1, tp=1, stage=0, tp_rank=0)
    model = build_stage(spec, shard, TPGroup(), args.device, dtype, reader)
    reader.close()
    bench = StageBench(
        model,
        args.context_tokens,
        args.attention,
        max(args.decode_batches, default=1),
        max(args.prefill_chunks, default=1),
    )
    rows: list[Row] = []
    bandwidth = 0.0
    for kind, sizes, make in (
        ("decode", args.decode_batches, bench.decode_seqs),
        ("prefill", args.prefill_chunks, bench.prefill_seqs),
    ):
        for n in sizes:
            seqs = make(n)
            ms = time_ms(partial(bench.step, seqs), args.device, args.repeats)
            rows.append(Row(kind, n, ms))
            if len(rows) == 1:
                # The copy right after the first point, with the same thread count: on a shared
                # machine the floor and the step it is compared with then see the same load.
                bandwidth = copy_bandwidth_bytes_per_s(args.device, args.copy_bytes)
    floor_ms = model.param_bytes / bandwidth * 1e3
    decode1_ms = rows[0].step_ms
    summary = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "device": args.device,
        "small_batch_kernel": args.small_batch_kernel,
        "threads": torch.get_num_threads(),
        "param_bytes": model.param_bytes,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "decode_floor_ms": floor_ms,
        "decode1_over_floor": decode1_ms / floor_ms,
        "context_tokens": args.context_tokens,
        "rows": [asdict(r) for r in rows],
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(
        f"{model_dir.name}: {model.param_bytes / 1e6:.1f} MB of {args.dtype} weights on "
        f"{args.device} ({torch.get_num_threads()} threads), decodes over "
        f"{args.context_tokens}-token contexts, attention={args.attention}\n"
    )
    print("| step | tokens | step ms | ms per token |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r.kind} | {r.tokens} | {r.step_ms:.2f} | {r.step_ms / r.tokens:.3f} |")
    print(
        f"\ncopy bandwidth {bandwidth / 1e9:.1f} GB/s; decode floor {floor_ms:.2f} ms "
        f"(weights / bandwidth); decode-1 is {decode1_ms / floor_ms:.2f}x the floor"
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stage", help="one stage's step time against tokens per step")
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", type=device(), default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--attention", default="torch", choices=["torch", "flashinfer"])
    p.add_argument(
        "--context-tokens", type=int_at_least(0), default=256, help="context of each decode"
    )
    p.add_argument(
        "--repeats", type=int_at_least(1), default=5, help="timed runs per point (median)"
    )
    p.add_argument(
        "--num-threads", type=int_at_least(0), default=0, help="torch threads (0: default)"
    )
    p.add_argument(
        "--random-shape",
        choices=sorted(SHAPES),
        help="write random weights of this shape to --model first if it holds no config.json",
    )
    sizes = comma_list(int_at_least(1), allow_empty=True)
    p.add_argument(
        "--decode-batches",
        type=sizes,
        default=DECODE_BATCHES,
        help="comma-separated decode batch sizes (empty: none)",
    )
    p.add_argument(
        "--prefill-chunks",
        type=sizes,
        default=PREFILL_CHUNKS,
        help="comma-separated prefill chunk lengths (empty: none)",
    )
    p.add_argument(
        "--copy-bytes",
        type=int_at_least(1),
        default=1 << 30,
        help="size of the bandwidth-measuring copy",
    )
    p.add_argument(
        "--small-batch-kernel",
        action="store_true",
        help="CPU bf16, one thread: steps of up to 2 tokens on the streaming GEMV kernel",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)
