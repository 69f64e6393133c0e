"""A Llama stage's decoder layers on the CPU as one plain loop over the package's C kernels and
the layers' matmuls: the kernels LlamaLayer.forward reaches, in the same order, on the same
values, with the Python between them cut to what the loop itself needs.

Why: on a 2-core CPU a decode step's kernels are short, and what lies between them is not.
`perf` on a warm stage (SmolLM2-135M, float32, an AVX2 EPYC) had the main thread in Python and
torch's dispatch for 36% of a decode step while the other core waited in OpenMP: a module call
per layer part, a DLPack capsule per tensor per kernel call, a fresh tensor per op, views and
splits (BENCHMARKS "A layer loop over the C kernels"). Here the weights are taken once, at load,
and a step's buffers and their capsules once for all of its layers. In bf16 the same cut saves
1.7 to 3.1 ms a step of the demo model on the AVX512-BF16 EPYC (BENCHMARKS "The layer loop in
bf16").

When: a Llama stage with TP=1 (nothing to all-reduce) on the CPU, the fused ops on, the step
prepared for the attention kernel, and either
- float32, every linear layer packed for the AVX2 matmul kernel (cpu_matmul.py), or
- bfloat16, every linear layer packed for oneDNN (onednn.py), for the package's bf16 kernel
  (matmul_bf16.py), or both, as that kernel's measured reach says; not with
  --small-batch-kernel.
Anything else runs the layers' modules, as does `--no-cpu-layer-loop` (to compare). Both give
the same hidden states bit for bit (tests/unit/stage_worker/test_cpu_layer_loop.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch

from stage_worker import native
from stage_worker.attention import AttentionBackend, AttentionMetadata
from stage_worker.attention.torch_backend import KernelStep
from stage_worker.kv_cache import KVCache
from stage_worker.layers import cpu_matmul, fused, linear
from stage_worker.layers.linear import ShardedLinear
from stage_worker.step_timer import TimedAttention, clock

if TYPE_CHECKING:
    from stage_worker.models.llama import LlamaLayer, LlamaStage

_enabled = True


def set_enabled(on: bool) -> None:
    """On by default; decides for the stages loaded from now on."""
    global _enabled
    _enabled = on


@dataclass(frozen=True)
class _LayerWeights:
    """One layer's weights as the loop hands them over: the norms as capsules for the C
    kernels (each holds its tensor alive), the matmuls' as their _Matmuls takes them."""

    input_norm: object  # [H]
    post_norm: object  # [H]
    qkv: object  # [(nq + 2 nkv) * D, H]
    o_proj: object  # [H, nq * D]
    gate_up: object  # [2F, H]
    down: object  # [H, F]
    eps: float  # both norms' (the spec's norm_eps)


@dataclass(frozen=True)
class _Shape:
    """The sizes a step's buffers take, per token."""

    hidden: int  # H
    q_heads: int  # nq, this rank's
    kv_heads: int  # nkv, this rank's
    head_dim: int  # D
    ffn: int  # F, this rank's


class _StepBuffers:
    """A step's activations, each allocated once and overwritten by every layer; `x` is the
    residual stream, updated in place. The capsules are of these tensors (or views of them).
    The qkv and gate_up products are the latest layer's: buffers of their own in float32,
    oneDNN's fresh outputs in bf16 (take_qkv, take_gate_up)."""

    def __init__(self, hidden: torch.Tensor, shape: _Shape, cos_sin: tuple[torch.Tensor, ...]):
        t, h, d, dtype = hidden.shape[0], shape.hidden, shape.head_dim, hidden.dtype
        nq, nkv = shape.q_heads, shape.kv_heads
        self.shape = shape
        self.x = hidden.clone(memory_format=torch.contiguous_format)  # [T, H]: not the caller's
        self.normed = torch.empty(t, h, dtype=dtype)
        qk = torch.empty(t, nq + nkv, d, dtype=dtype)  # rotated: q heads, then k heads
        self.k = qk[:, nq:]  # [T, nkv, D]
        self.q_rotated = qk[:, :nq]  # [T, nq, D], strided
        self.q = torch.empty(t, nq, d, dtype=dtype)  # the same, contiguous, as attention reads it
        attended = torch.empty(t, nq, d, dtype=dtype)
        self.attended_rows = attended.view(t, nq * d)  # as o_proj reads it
        self.act = torch.empty(t, shape.ffn, dtype=dtype)
        cos, sin = cos_sin  # [T, 1, D] each
        capsule = native.capsule
        self.c_x, self.c_normed = capsule(self.x), capsule(self.normed)
        self.c_qk, self.c_q = capsule(qk), capsule(self.q)
        self.c_cos, self.c_sin = capsule(cos.flatten(1)), capsule(sin.flatten(1))
        self.c_attended = capsule(attended)  # as the attention kernel writes it
        self.c_attended_rows = capsule(self.attended_rows)
        self.c_act = capsule(self.act)
        self.v = torch.empty(0)  # [T, nkv, D], a view of the latest qkv product
        self.c_qkv: object = None
        self.c_qk_in: object = None  # [T, nq + nkv, D] of the latest qkv product
        self.c_gate_up: object = None

    def take_qkv(self, qkv: torch.Tensor) -> None:
        """qkv: [T, (nq + 2 nkv) * D], the q, k and v heads side by side."""
        t, d = qkv.shape[0], self.shape.head_dim
        nq, nkv = self.shape.q_heads, self.shape.kv_heads
        self.v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)  # [T, nkv, D]
        self.c_qkv = native.capsule(qkv)
        self.c_qk_in = native.capsule(qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d))

    def take_gate_up(self, gate_up: torch.Tensor) -> None:
        """gate_up: [T, 2F], where SiLU is a pass of its own."""
        self.c_gate_up = native.capsule(gate_up)


class _Float32Matmuls:
    """The package's AVX2 kernel on its panels (cpu_matmul.py): products into the step's own
    buffers, o_proj's and down's added into the residual stream inside the kernel, and the gate
    projection's SiLU applied there too where F fills whole panels of 16 outputs (its time then
    counts as the linear layers')."""

    def __init__(self, kernels: ModuleType, ffn: int) -> None:
        self.kernels = kernels
        self.silu_in_matmul = ffn % cpu_matmul.PANEL == 0

    def new_step(self, b: _StepBuffers) -> None:
        t, shape = b.x.shape[0], b.shape
        b.take_qkv(torch.empty(t, (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim))
        if not self.silu_in_matmul:
            b.take_gate_up(torch.empty(t, 2 * shape.ffn))

    def qkv(self, b: _StepBuffers, w: object, threads: int) -> None:
        self.kernels.sgemm_f32(b.c_normed, w, b.c_qkv, threads)

    def add_o_proj(self, b: _StepBuffers, w: object, threads: int) -> None:
        self.kernels.sgemm_f32(b.c_attended_rows, w, b.c_x, threads, True)  # x += o_proj

    def gate_up(self, b: _StepBuffers, w: object, threads: int) -> None:
        if self.silu_in_matmul:  # SiLU on the products in L1, on every thread
            self.kernels.sgemm_f32_silu_mul(b.c_normed, w, b.c_act, threads)
        else:
            self.kernels.sgemm_f32(b.c_normed, w, b.c_gate_up, threads)

    def add_down(self, b: _StepBuffers, w: object, threads: int) -> None:
        self.kernels.sgemm_f32(b.c_act, w, b.c_x, threads, True)  # x += down


class _Bf16Matmuls:
    """The layers' own bf16 matmuls (ShardedLinear.matmul: the package's bf16 kernel for the
    steps of its reach, oneDNN's packed kernel for more), on torch's threads: each product a
    fresh tensor (oneDNN writes no given buffer), added into the residual stream in place,
    rounded as the modules' `x + o_proj(...)` rounds it."""

    silu_in_matmul = False

    def new_step(self, b: _StepBuffers) -> None:
        pass

    def qkv(self, b: _StepBuffers, w: object, threads: int) -> None:
        b.take_qkv(cast(ShardedLinear, w).matmul(b.normed))

    def add_o_proj(self, b: _StepBuffers, w: object, threads: int) -> None:
        b.x.add_(cast(ShardedLinear, w).matmul(b.attended_rows))

    def gate_up(self, b: _StepBuffers, w: object, threads: int) -> None:
        b.take_gate_up(cast(ShardedLinear, w).matmul(b.normed))

    def add_down(self, b: _StepBuffers, w: object, threads: int) -> None:
        b.x.add_(cast(ShardedLinear, w).matmul(b.act))


class CpuLayerLoop:
    """The layers of one Llama stage, run as a loop over the C kernels (see the module's doc)."""

    def __init__(self, layers: Sequence[_LayerWeights], shape: _Shape, dtype: torch.dtype) -> None:
        self.layers = list(layers)
        self.shape = shape
        self.dtype = dtype
        kernels = native.fused_kernels()
        assert kernels is not None, "CpuLayerLoop built where the C kernels do not run"
        self.kernels = kernels
        self.matmuls: _Float32Matmuls | _Bf16Matmuls = (
            _Float32Matmuls(kernels, shape.ffn) if dtype == torch.float32 else _Bf16Matmuls()
        )
        self._caches: _CacheViews | None = None

    @classmethod
    def build(cls, model: LlamaStage) -> CpuLayerLoop | None:
        """The loop for a loaded, packed stage, or None where it does not apply (then the
        layers' modules run): decided once, after pack()."""
        layers = model.llama_layers()
        if not (
            _enabled
            and native.fused_kernels() is not None
            and model.tp.size == 1
            and model.dtype in (torch.float32, torch.bfloat16)
            and model.device == "cpu"
            and layers
        ):
            return None
        weights = [_weights(layer, model.dtype) for layer in layers]
        if any(w is None for w in weights):
            return None
        first = layers[0]
        shape = _Shape(
            model.spec.hidden_size,
            len(first.q_heads),
            len(first.kv_heads),
            model.spec.head_dim,
            first.ffn_local,
        )
        return cls([w for w in weights if w is not None], shape, model.dtype)

    @property
    def silu_in_matmul(self) -> bool:
        return self.matmuls.silu_in_matmul

    def step_for(
        self, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> KernelStep | None:
        """This step's attention-kernel state where the loop takes the step, else None."""
        step = meta.extra.get("cpu_kernel")
        if (
            not isinstance(step, KernelStep)
            or fused.kernels_for(hidden) is None  # --no-fused-ops: the modules' torch ops
            or hidden.dtype != self.dtype
            or kv_cache.data.dtype != self.dtype
            or not kv_cache.data.is_contiguous()
        ):
            return None
        return step

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        step: KernelStep,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """hidden: [T, H] -> [T, H] after every layer, as the modules compute it. The matmuls'
        time goes to the linear layers' clock and the KV write and attention kernel's to a
        TimedAttention, as the modules' would (stage_worker/step_timer.py)."""
        b = _StepBuffers(hidden, self.shape, cos_sin)
        mm, kernels, threads = self.matmuls, self.kernels, torch.get_num_threads()
        mm.new_step(b)
        scale = self.shape.head_dim**-0.5
        slots = meta.slot_mapping  # [T] int64
        c_table, c_lens = native.capsule(step.block_table), native.capsule(step.context_lens)
        c_scratch = native.capsule(step.scratch)
        caches = self._cache_views(kv_cache)
        linear_s = attention_s = 0.0
        for w, (k_by_slot, v_by_slot, c_k_cache, c_v_cache) in zip(
            self.layers, caches.layers, strict=True
        ):
            kernels.fused_rms_norm(b.c_x, w.input_norm, b.c_normed, w.eps, threads)
            t0 = clock()
            mm.qkv(b, w.qkv, threads)
            t1 = clock()
            kernels.fused_rotary(b.c_qk_in, b.c_cos, b.c_sin, b.c_qk, threads)
            t2 = clock()
            k_by_slot.index_copy_(0, slots, b.k)
            v_by_slot.index_copy_(0, slots, b.v)
            b.q.copy_(b.q_rotated)
            kernels.paged_attention(
                b.c_q, c_k_cache, c_v_cache, c_table, c_lens, c_scratch, b.c_attended, scale,
                step.threads,
            )  # fmt: skip
            t3 = clock()
            mm.add_o_proj(b, w.o_proj, threads)  # x += o_proj
            t4 = clock()
            kernels.fused_rms_norm(b.c_x, w.post_norm, b.c_normed, w.eps, threads)
            t5 = clock()
            mm.gate_up(b, w.gate_up, threads)
            t6 = clock()
            if not mm.silu_in_matmul:
                kernels.fused_silu_mul(b.c_gate_up, b.c_act, threads)
            t7 = clock()
            mm.add_down(b, w.down, threads)  # x += down
            t8 = clock()
            linear_s += (t1 - t0) + (t4 - t3) + (t6 - t5) + (t8 - t7)
            attention_s += t3 - t2
        _book(linear_s, attention_s, attention)
        return b.x

    def _cache_views(self, kv_cache: KVCache) -> _CacheViews:
        """Views and capsules of each layer's K and V, made at the first step over this cache
        (a worker keeps one cache for its model's life)."""
        if self._caches is None or self._caches.cache is not kv_cache:
            self._caches = _CacheViews(kv_cache, self.shape)
        return self._caches


class _CacheViews:
    def __init__(self, kv_cache: KVCache, shape: _Shape) -> None:
        self.cache = kv_cache
        num_layers = kv_cache.data.shape[0]
        # [layers, 2, blocks + 1, block_size, nkv, D] -> each layer's K or V by flat slot
        by_slot = kv_cache.data.view(num_layers, 2, -1, shape.kv_heads, shape.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor, object, object]] = []
        """Per layer: K and V as [slots, nkv, D] (to write), capsules of K and V as
        [blocks + 1, block_size, nkv, D] (for the attention kernel)."""
        for index in range(num_layers):
            k_cache, v_cache = kv_cache.layer(index)
            self.layers.append(
                (by_slot[index, 0], by_slot[index, 1], native.capsule(k_cache),
                 native.capsule(v_cache))
            )  # fmt: skip


def _weights(layer: LlamaLayer, dtype: torch.dtype) -> _LayerWeights | None:
    """The layer's weights for the loop, or None where one of its matmuls is not on the loop's
    kernels: a float32 weight the AVX2 kernel did not take (--no-cpu-matmul-kernel), a bf16 one
    neither oneDNN nor the bf16 kernel packed, or that the small-batch kernel also reads
    (--small-batch-kernel). A bf16 layer's matmuls are its modules (ShardedLinear), called past
    their __call__."""
    mats = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    norms = (layer.input_norm.weight.data, layer.post_norm.weight.data)
    if not all(n.is_contiguous() for n in norms):
        return None
    taken: list[object] = []
    for m in mats:
        if dtype == torch.float32 and m.f32 is not None:
            taken.append(native.capsule(m.f32.panels))
        elif (
            dtype == torch.bfloat16
            and (m.weight.is_mkldnn or m.bf16 is not None)
            and m.plain is None
        ):
            taken.append(m)  # its matmul picks the kernel by the step's tokens
        else:
            return None
    qkv, o_proj, gate_up, down = taken
    capsule = native.capsule
    assert layer.input_norm.eps == layer.post_norm.eps
    return _LayerWeights(
        capsule(norms[0]), capsule(norms[1]), qkv, o_proj, gate_up, down, layer.input_norm.eps
    )


def _book(linear_s: float, attention_s: float, attention: AttentionBackend) -> None:
    """The loop's phase times where the step timer reads them (it is on where both clocks are)."""
    if linear.CLOCK.on:
        linear.CLOCK.seconds += linear_s
    if isinstance(attention, TimedAttention):
        attention.seconds += attention_s
