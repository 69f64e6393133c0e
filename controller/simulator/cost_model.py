"""A physics cost model of one pipeline stage running one micro-batch.

Per stage and micro-batch of N tokens (the stage holds L = num_layers / PP layers, its GPUs hold
1/TP of every matmul):

- linear layers: max(FLOPs / (peak * MATMUL_FLOPS_EFF), weight bytes / (bandwidth *
  MATMUL_MEMORY_EFF)): 2 FLOPs per parameter per token; the weights are read once per step;
- attention: a prefill chunk of c tokens at context k costs 4 * heads * head_dim * c * (k - c/2)
  FLOPs (QK^T and PV, causal) or its KV reads, whichever is slower; a decode reads its context's
  KV bytes (memory-bound, ATTENTION_MEMORY_EFF);
- tensor parallel: two ring all-reduces of N * hidden * 2 bytes per layer over the TP link;
- pipeline: one activation transfer (N * hidden * 2 bytes / bandwidth + latency) per boundary;
- the LM head on the last stage for the tokens that are sampled; a fixed per-step overhead and a
  per-layer kernel-launch overhead on every stage.

Efficiency factors (fields of `Efficiency`, with their defaults; none is fitted to the paper):
- matmul_flops = 0.70: large BF16 GEMMs reach about 70-80% of the A100's 312 TFLOPS (NVIDIA
  "Matrix Multiplication Background User's Guide", Deep Learning Performance docs); serving
  shapes are smaller, so the low end. The paper's footnote 2 (linear layers turn compute-bound at
  500-600 tokens, not the ~200 that peak numbers predict) agrees with these losses plus launches.
- matmul_memory = 0.80: streaming reads reach 80-90% of datasheet HBM bandwidth (STREAM-like
  copy kernels on A100); decode GEMVs sit at the low end.
- attention_flops = 0.50: FlashAttention-2 forward reaches 50-73% of peak on A100 (Dao,
  "FlashAttention-2", 2023, section 4.1); paged, chunked kernels at serving shapes: low end.
- attention_memory = 0.60: paged decode attention is gather-heavy; the vLLM paper (Kwon et al.,
  SOSP'23, section 7) reports its PagedAttention kernel 20-26% slower than contiguous kernels
  that are themselves below peak bandwidth.
- link = 0.80: NCCL bus bandwidth reaches about 80% of the line rate for large messages
  (nccl-tests on NVLink and on 100 GbE RoCE).
- layer_overhead_s = 20 us: about eight kernels per layer in eager PyTorch at 2-3 us launch
  each; the paper's vLLM-0.2-based engine ran mixed batches without CUDA graphs.
- step_overhead_s = 3 ms: CPU time per iteration to build inputs, sample and post-process in a
  vLLM-0.2-based engine such as the paper's (vLLM's v0.6.0 release notes found CPU overhead a
  large share of each step). An assumption of the right order, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from controller.scheduler import MicroBatch
from controller.simulator.hardware import GpuSpec, LinkSpec, get_link
from controller.simulator.models import BYTES_PER_PARAM, ModelSpec


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of datasheet rates, and fixed overheads (sources in the module doc)."""

    matmul_flops: float = 0.70
    matmul_memory: float = 0.80
    attention_flops: float = 0.50
    attention_memory: float = 0.60
    link: float = 0.80
    layer_overhead_s: float = 20e-6
    step_overhead_s: float = 3e-3

    def __post_init__(self) -> None:
        for name in (
            "matmul_flops",
            "matmul_memory",
            "attention_flops",
            "attention_memory",
            "link",
        ):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {value}")
        if self.layer_overhead_s < 0 or self.step_overhead_s < 0:
            raise ValueError("overheads must be >= 0 seconds")


@dataclass(frozen=True)
class Deployment:
    """A model on GPUs: TP GPUs per stage, PP stages; which link carries what."""

    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1
    pp: int = 1
    stage_link: LinkSpec = field(default_factory=lambda: get_link("eth-100g"))
    """Between pipeline stages (each stage on its own node) and between the nodes of a TP group."""
    tp_link: LinkSpec = field(default_factory=lambda: get_link("nvlink"))
    """Between the GPUs of one TP group inside a node."""
    nodes_per_stage: int = 1
    """Nodes one TP group spans (TP8 over two 4-GPU nodes: 2); >1 puts all-reduces on stage_link."""
    gpu_memory_utilization: float = 0.90
    """Share of GPU memory the engine may use (weights, activations, KV cache)."""
    block_size: int = 16
    max_batch_tokens: int = 4096
    """Largest micro-batch in tokens, for the activation memory reserve."""
    min_kv_tokens: int = 4096
    """KV-cache tokens the layout must hold at least (one sequence at max_model_len)."""

    def __post_init__(self) -> None:
        m = self.model
        for name in ("tp", "pp", "nodes_per_stage", "block_size", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if m.num_layers % self.pp:
            raise ValueError(
                f"{m.name} has {m.num_layers} layers, not divisible into pp={self.pp} stages"
            )
        if m.num_heads % self.tp:
            raise ValueError(
                f"{m.name} has {m.num_heads} attention heads, not divisible by tp={self.tp}"
            )
        if m.num_kv_heads % self.tp and self.tp % m.num_kv_heads:
            raise ValueError(
                f"{m.name} has {m.num_kv_heads} KV heads: tp={self.tp} must divide them or be a "
                "multiple of them"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        need, have = self.min_kv_tokens, self.kv_capacity_tokens
        if have < need:
            raise ValueError(
                f"tp={self.tp} pp={self.pp} cannot hold {m.name} on {self.gpu.name}: "
                f"{self.weight_bytes_per_gpu / 1e9:.1f} GB weights + "
                f"{self.activation_bytes_per_gpu / 1e9:.1f} GB activations per GPU leave room for "
                f"{max(have, 0)} KV tokens of the {need} needed "
                f"({need * self.kv_bytes_per_token_per_gpu / 1e9:.2f} GB) within "
                f"{self.gpu_memory_utilization:.0%} of {self.gpu.memory_bytes / 1e9:.1f} GB"
            )

    @property
    def layers_per_stage(self) -> int:
        return self.model.num_layers // self.pp

    @property
    def kv_heads_per_gpu(self) -> int:
        # Fewer KV heads than TP ranks: each rank keeps a replica of one.
        return max(1, self.model.num_kv_heads // self.tp)

    @property
    def weight_bytes_per_gpu(self) -> int:
        """The largest stage's share per GPU: its layers, plus the embedding (first stage) and
        the LM head (last stage), both vocabulary-parallel."""
        m = self.model
        layers = self.layers_per_stage * m.linear_params_per_layer
        ends = m.embedding_params * (2 if self.pp == 1 else 1)
        return (layers + ends) * BYTES_PER_PARAM // self.tp

    @property
    def activation_bytes_per_gpu(self) -> int:
        m = self.model
        width = 4 * m.hidden_size + m.num_mlp_matrices * m.ffn_hidden_size // self.tp
        return self.max_batch_tokens * width * BYTES_PER_PARAM

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """K and V of one token over this stage's layers, on one GPU."""
        return (
            2
            * self.kv_heads_per_gpu
            * self.model.head_dim
            * BYTES_PER_PARAM
            * self.layers_per_stage
        )

    @property
    def kv_capacity_tokens(self) -> int:
        usable = self.gpu.memory_bytes * self.gpu_memory_utilization
        free = usable - self.weight_bytes_per_gpu - self.activation_bytes_per_gpu
        return int(free // self.kv_bytes_per_token_per_gpu)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size


@dataclass(frozen=True)
class StageCost:
    stage_times_s: list[float]
    """Compute time of the micro-batch on each stage, in stage order."""
    transfer_s: float
    """Activation transfer between two consecutive stages."""
    return_s: float = 0.0
    """After the last stage: until the scheduler has the result and its next plan could start
    (a live controller's turnaround; 0 for the analytic model, whose step overhead holds it)."""


class AnalyticCostModel:
    """Per-model constants precomputed once; per micro-batch only a pass over its chunks."""

    def __init__(self, deployment: Deployment, efficiency: Efficiency | None = None) -> None:
        d, m = deployment, deployment.model
        e = efficiency or Efficiency()
        self.deployment = d
        self.efficiency = e
        self.num_stages = d.pp
        gpu, tp, layers = d.gpu, d.tp, d.layers_per_stage
        flops_rate = gpu.peak_flops * e.matmul_flops
        mem_rate = gpu.memory_bandwidth_bytes_s * e.matmul_memory
        params_per_gpu = layers * m.linear_params_per_layer / tp
        # Linear layers: time = max(tokens * per_token_s, weights_read_s).
        self._linear_per_token_s = 2.0 * params_per_gpu / flops_rate
        self._linear_weights_s = params_per_gpu * BYTES_PER_PARAM / mem_rate
        # Attention: per query-key pair FLOPs and per context-token KV bytes, all layers.
        heads_per_gpu = m.num_heads // tp
        self._attn_pair_s = (
            4.0 * heads_per_gpu * m.head_dim * layers / (gpu.peak_flops * e.attention_flops)
        )
        self._attn_kv_token_s = d.kv_bytes_per_token_per_gpu / (
            gpu.memory_bandwidth_bytes_s * e.attention_memory
        )
        self._window = m.sliding_window_tokens
        # Two all-reduces per layer; ring: 2 (tp-1) steps, each moving bytes/tp per GPU.
        activation_bytes_per_token = m.hidden_size * BYTES_PER_PARAM
        if tp > 1:
            link = d.stage_link if d.nodes_per_stage > 1 else d.tp_link
            rate = link.bandwidth_bytes_s * e.link
            self._allreduce_fixed_s = 2 * layers * 2 * (tp - 1) * link.latency_s
            self._allreduce_per_token_s = (
                2 * layers * 2 * (tp - 1) / tp * activation_bytes_per_token / rate
            )
        else:
            self._allreduce_fixed_s = 0.0
            self._allreduce_per_token_s = 0.0
        # LM head (vocabulary-parallel) on the last stage, for sampled tokens only.
        head_params = m.embedding_params / tp
        self._head_per_token_s = 2.0 * head_params / flops_rate
        self._head_weights_s = head_params * BYTES_PER_PARAM / mem_rate
        self._fixed_s = e.step_overhead_s + layers * e.layer_overhead_s
        link = d.stage_link
        self._transfer_fixed_s = link.latency_s
        self._transfer_per_token_s = activation_bytes_per_token / (link.bandwidth_bytes_s * e.link)

    def stage_time_s(self, num_tokens: int, attention_s: float) -> float:
        """One middle stage's time for num_tokens whose attention costs attention_s."""
        linear = max(num_tokens * self._linear_per_token_s, self._linear_weights_s)
        allreduce = self._allreduce_fixed_s + num_tokens * self._allreduce_per_token_s
        return linear + attention_s + allreduce + self._fixed_s

    def attention_s(self, batch: MicroBatch) -> tuple[float, int]:
        """Attention time of a micro-batch on one stage, and how many tokens it samples."""
        pair_s, kv_s, window = self._attn_pair_s, self._attn_kv_token_s, self._window
        decode_context = 0
        prefill_s = 0.0
        num_sampled = 0
        block = batch.decodes
        if block is not None:  # the decode roster's decodes, as columns: no per-decode records
            contexts = block.positions + 1
            if window:
                contexts = np.minimum(contexts, window)
            decode_context = int(contexts.sum())
            num_sampled = len(block.seq_ids)
        for chunk in batch.other_chunks:
            n = chunk.num_tokens
            context = chunk.first_position + n
            if chunk.yields_token:
                num_sampled += 1
            if window and context > window:
                context = window
            if n == 1:
                decode_context += context
            else:
                # Causal: query i of the chunk sees (context - n + i + 1) keys.
                flops_s = n * (context - (n - 1) / 2) * pair_s
                kv_read_s = context * kv_s
                prefill_s += flops_s if flops_s > kv_read_s else kv_read_s
        return prefill_s + decode_context * kv_s, num_sampled

    def micro_batch_cost(self, batch: MicroBatch) -> StageCost:
        attention, num_sampled = self.attention_s(batch)
        n = batch.num_tokens
        middle = self.stage_time_s(n, attention)
        times = [middle] * self.num_stages
        if num_sampled:
            times[-1] += max(num_sampled * self._head_per_token_s, self._head_weights_s)
        return StageCost(times, self.transfer_s(n))

    def transfer_s(self, num_tokens: int) -> float:
        """Activations of num_tokens from one stage to the next."""
        return self._transfer_fixed_s + num_tokens * self._transfer_per_token_s

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        """End-to-end time of one decode-only step (all stages and transfers), as the paper sizes
        its SLOs: batch_size sequences each at context_tokens."""
        context = min(context_tokens, self._window) if self._window else context_tokens
        stage = self.stage_time_s(batch_size, batch_size * context * self._attn_kv_token_s)
        head = max(batch_size * self._head_per_token_s, self._head_weights_s)
        return self.num_stages * stage + head + (self.num_stages - 1) * self.transfer_s(batch_size)
