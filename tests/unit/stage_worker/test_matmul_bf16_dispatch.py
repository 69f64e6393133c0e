"""How far a CPU's bf16 steps run the package's kernel rather than oneDNN, measured at load
(stage_worker/layers/matmul_bf16_dispatch.py): the crossover rule, the weights a sweep reads,
a real measurement, and what the worker does with it, panels freed where the kernel never
wins."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from sarathictl.bench.random_model import write_random_llama

from stage_worker import native, worker
from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ShardSpec, load_spec
from stage_worker.layers import matmul_bf16, matmul_bf16_dispatch
from stage_worker.layers.linear import ShardedLinear
from stage_worker.layers.matmul_bf16_dispatch import Calibration, crossover
from stage_worker.models import build_stage
from stage_worker.models.base import StageModel

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


KERNEL_MS = (5, 5, 6, 11, 15, 19, 35, 68, 130)
UNBOUNDED = matmul_bf16.UNBOUNDED


@pytest.mark.parametrize(
    ("onednn_ms", "want"),
    [
        ((7, 8, 10, 14, 17, 21, 38, 70, 135), UNBOUNDED),  # the Zen 5 EPYC's shape
        ((7, 8, 10, 9, 9, 10, 15, 28, 50), 16),  # oneDNN ahead from 32 (AMX-like)
        ((7, 8, 5, 14, 17, 21, 38, 70, 135), 8),  # the first loss ends the reach
        ((4, 8, 10, 14, 17, 21, 38, 70, 135), 0),  # slower even at one token
        (KERNEL_MS, UNBOUNDED),  # a tie keeps the kernel, at every size
        ((5, 5, 6, 11, 15, 19, 35, 68, 124.2), UNBOUNDED),  # 4.7% slower at 512: noise
        ((5, 5, 6, 11, 15, 19, 35, 68, 123.4), 256),  # 5.3% slower at 512: a loss
    ],
    ids=["kernel-ahead", "onednn-ahead-from-32", "first-loss", "never", "ties", "noise", "loss"],
)
def test_the_kernel_keeps_the_counts_up_to_its_first_loss(
    onednn_ms: tuple[float, ...], want: int
) -> None:
    assert crossover(COUNTS, KERNEL_MS, onednn_ms) == want


def test_a_sweep_past_the_streamed_counts_reads_fewer_weights() -> None:
    full = matmul_bf16_dispatch.SWEEP_BYTES
    assert [matmul_bf16_dispatch.sweep_bytes(n) for n in (1, 64, 128, 512)] == [
        full,
        full,
        full // 2,
        full // 8,
    ]


def test_a_sweep_reads_the_first_weights_up_to_its_bytes() -> None:
    def pair(out: int) -> tuple[torch.Tensor, matmul_bf16.PackedBf16]:
        panels = torch.empty(out // 16, 32, 16, 2, dtype=torch.bfloat16)  # out * 64 * 2 bytes
        return torch.empty(0), matmul_bf16.PackedBf16(panels, out, 64)

    pairs = [pair(16), pair(32), pair(64), pair(16)]  # 2, 4, 8 and 2 KiB of panels
    sweep = matmul_bf16_dispatch.sweep_weights
    assert [p[1].out_features for p in sweep(pairs, 6 << 10)] == [16, 32]
    assert len(sweep(pairs, 1 << 30)) == 4  # more than all: all


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
    reach = "at every step size" if got.unbounded else f"up to {got.max_tokens} tokens"
    assert got.describe().startswith(f"bf16 matmul kernel {reach}")


def _tiny_stage(checkpoint: Path, pp: int = 1, stage: int = 0) -> StageModel:
    model_dir = str(checkpoint)
    reader = CheckpointReader(model_dir)
    shard = ShardSpec(pp=pp, tp=1, stage=stage, tp_rank=0)
    model = build_stage(load_spec(model_dir), shard, TPGroup(), "cpu", torch.bfloat16, reader)
    reader.close()
    return model


def _measured(
    monkeypatch: pytest.MonkeyPatch, max_tokens: int, offered: list[int] | None = None
) -> None:
    """The worker's measurement replaced by one that finds `max_tokens`."""

    def measure(pairs: matmul_bf16_dispatch.Weights) -> Calibration:
        if offered is not None:
            offered.append(len(pairs))
        return Calibration((1, 16, 32), (1.0, 1.0, 1.0), (2.0, 2.0, 0.5), max_tokens)

    monkeypatch.setattr(matmul_bf16_dispatch, "measure", measure)


@needs_kernel
@pytest.mark.parametrize("measured", [16, 0], ids=["reach-16", "never-faster"])
def test_the_worker_runs_the_kernel_as_far_as_measured_and_frees_panels_it_never_uses(
    monkeypatch: pytest.MonkeyPatch,
    tiny_checkpoint: Callable[[str], Path],
    measured: int,
    reach: None,
) -> None:
    model = _tiny_stage(tiny_checkpoint("llama"))
    layers, copies = len(model.bf16_panels()), model.kernel_copy_bytes
    assert layers and model.lm_head is not None and model.lm_head.bf16 is not None
    timed: list[int] = []
    _measured(monkeypatch, measured, timed)
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


@needs_kernel
@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "untied-head"])
def test_a_kernel_faster_at_every_size_holds_each_weight_once_and_computes_the_same(
    monkeypatch: pytest.MonkeyPatch,
    tiny_checkpoint: Callable[[str], Path],
    tmp_path: Path,
    tied: bool,
    reach: None,
) -> None:
    # tied: the head's rows are the embedding's (as the demo model's), which looks them up
    checkpoint = (
        write_random_llama(tmp_path / "tied", "tiny", torch.bfloat16)
        if tied
        else tiny_checkpoint("llama")
    )
    model = _tiny_stage(checkpoint)
    assert model.lm_head is not None and model.embed is not None
    assert (model.lm_head.weight is model.embed.weight) == tied
    assert model.kernel_copy_bytes > 0
    held_before = model.param_bytes + model.kernel_copy_bytes
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(100, model.spec.hidden_size, generator=gen).to(torch.bfloat16)
    layer = model.bf16_panels()[0]  # (oneDNN's weight, panels): 100 tokens ran on oneDNN
    from_onednn = matmul_bf16_dispatch.onednn.linear(hidden, layer[0]).float()
    logits_before = model.compute_logits(hidden)
    token_ids = torch.tensor([0, 5, model.spec.vocab_size - 1])
    rows_before = model.embed(token_ids)

    _measured(monkeypatch, UNBOUNDED)
    worker._measure_bf16_reach(model)

    linears = [m for m in model.modules() if isinstance(m, ShardedLinear)]
    assert linears and all(
        m.bf16 is not None and m.weight.data_ptr() == m.bf16.panels.data_ptr() for m in linears
    )
    # the panels are the parameters now; a tied head's beside the embedding's rows
    head_panels = model.lm_head.bf16
    assert head_panels is not None
    assert model.kernel_copy_bytes == (head_panels.panels.nbytes if tied else 0)
    assert model.param_bytes + model.kernel_copy_bytes < 0.75 * held_before
    first = linears[0]
    torch.testing.assert_close(first(hidden).float(), from_onednn, rtol=2**-7, atol=0.01)
    # the kernel's float32 sums, against oneDNN's with the top ones refined
    torch.testing.assert_close(model.compute_logits(hidden), logits_before, rtol=2**-7, atol=0.01)
    assert torch.equal(model.embed(token_ids), rows_before)
    assert (model.lm_head.weight is model.embed.weight) == tied
