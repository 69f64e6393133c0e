"""How far a CPU's bf16 steps run the package's kernel rather than oneDNN, measured at load
(stage_worker/layers/matmul_bf16_dispatch.py): the crossover rule, the weights a sweep reads,
a real measurement, and what the worker does with it, panels freed where the kernel never
wins."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from stage_worker import native, worker
from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ShardSpec, load_spec
from stage_worker.layers import matmul_bf16, matmul_bf16_dispatch
from stage_worker.layers.matmul_bf16_dispatch import Calibration, crossover
from stage_worker.models import build_stage

COUNTS = matmul_bf16_dispatch.COUNTS

needs_kernel = pytest.mark.skipif(
    native.kernels() is None, reason="the bf16 kernels do not run here (AVX-512 with bf16)"
)


@pytest.fixture
def reach() -> Iterator[None]:
    """The process-wide reach as it was before the test."""
    before = matmul_bf16.REACH.max_tokens
    yield
    matmul_bf16.REACH.max_tokens = before


@pytest.mark.parametrize(
    ("kernel_ms", "onednn_ms", "want"),
    [
        ((5, 5, 6, 11, 15, 19), (7, 8, 10, 14, 17, 21), 64),  # the Zen 5 EPYC's shape
        ((5, 5, 6, 11, 15, 19), (7, 8, 10, 9, 9, 10), 16),  # oneDNN ahead from 32 (AMX-like)
        ((5, 5, 6, 11, 15, 19), (7, 8, 5, 14, 17, 21), 8),  # the first loss ends the reach
        ((5, 5, 6, 11, 15, 19), (4, 8, 10, 14, 17, 21), 0),  # slower even at one token
        ((5, 5, 6, 11, 15, 19), (5, 5, 6, 11, 15, 19), 64),  # a tie keeps the kernel
        ((5, 5, 6, 11, 15, 19.9), (5, 5, 6, 11, 15, 19), 64),  # 4.7% slower: noise, kept
        ((5, 5, 6, 11, 15, 20.0), (5, 5, 6, 11, 15, 19), 48),  # 5.3% slower: a loss
    ],
    ids=["kernel-ahead", "onednn-ahead-from-32", "first-loss", "never", "ties", "noise", "loss"],
)
def test_the_kernel_keeps_the_counts_up_to_its_first_loss(
    kernel_ms: tuple[float, ...], onednn_ms: tuple[float, ...], want: int
) -> None:
    assert crossover(COUNTS, kernel_ms, onednn_ms) == want


def test_a_sweep_reads_the_first_weights_up_to_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    def pair(out: int) -> tuple[torch.Tensor, matmul_bf16.PackedBf16]:
        panels = torch.empty(out // 16, 32, 16, 2, dtype=torch.bfloat16)  # out * 64 * 2 bytes
        return torch.empty(0), matmul_bf16.PackedBf16(panels, out, 64)

    pairs = [pair(16), pair(32), pair(64), pair(16)]  # 2, 4, 8 and 2 KiB of panels
    monkeypatch.setattr(matmul_bf16_dispatch, "SWEEP_BYTES", 6 << 10)
    assert [p[1].out_features for p in matmul_bf16_dispatch.sweep_weights(pairs)] == [16, 32]
    monkeypatch.setattr(matmul_bf16_dispatch, "SWEEP_BYTES", 1 << 30)  # more than all: all
    assert len(matmul_bf16_dispatch.sweep_weights(pairs)) == 4


@needs_kernel
def test_a_real_measurement_times_both_at_every_count_and_says_so() -> None:
    torch.manual_seed(0)
    pairs = []
    for out, in_ in ((96, 64), (64, 96)):
        weight = torch.randn(out, in_).to(torch.bfloat16)
        pairs.append((weight, matmul_bf16.pack(weight)))
    got = matmul_bf16_dispatch.measure(pairs, counts=(1, 4), rounds=1)
    assert got.counts == (1, 4) and len(got.kernel_ms) == len(got.onednn_ms) == 2
    assert all(t > 0 for t in got.kernel_ms + got.onednn_ms)
    assert got.max_tokens == crossover(got.counts, got.kernel_ms, got.onednn_ms)
    assert got.describe().startswith(f"bf16 matmul kernel up to {got.max_tokens} tokens")


@needs_kernel
@pytest.mark.parametrize("measured", [16, 0], ids=["reach-16", "never-faster"])
def test_the_worker_runs_the_kernel_as_far_as_measured_and_frees_panels_it_never_uses(
    monkeypatch: pytest.MonkeyPatch,
    tiny_checkpoint: Callable[[str], Path],
    measured: int,
    reach: None,
) -> None:
    model_dir = str(tiny_checkpoint("llama"))
    reader = CheckpointReader(model_dir)
    shard = ShardSpec(pp=1, tp=1, stage=0, tp_rank=0)
    model = build_stage(load_spec(model_dir), shard, TPGroup(), "cpu", torch.bfloat16, reader)
    reader.close()
    layers, copies = len(model.bf16_panels()), model.kernel_copy_bytes
    assert layers and model.lm_head is not None and model.lm_head.bf16 is not None
    timed: list[int] = []

    def measure(pairs: matmul_bf16_dispatch.Weights) -> Calibration:
        timed.append(len(pairs))
        return Calibration((1, 16, 32), (1.0, 1.0, 1.0), (2.0, 2.0, 0.5), measured)

    monkeypatch.setattr(matmul_bf16_dispatch, "measure", measure)
    worker._measure_bf16_reach(model)
    assert timed == [layers]  # every linear layer's weight offered
    assert matmul_bf16.REACH.max_tokens == measured
    if measured:
        assert len(model.bf16_panels()) == layers and model.kernel_copy_bytes == copies
    else:  # never faster: no panels held, the head on oneDNN and its exact top logits
        assert not model.bf16_panels() and model.lm_head.bf16 is None
        assert model.kernel_copy_bytes < copies
        hidden = torch.randn(3, model.spec.hidden_size).to(torch.bfloat16)
        assert model.compute_logits(hidden).dtype == torch.float32
