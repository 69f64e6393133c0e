"""How far a CPU's bf16 steps run the package's kernel rather than oneDNN, measured before a
worker loads (stage_worker/layers/matmul_bf16_dispatch.py): the crossover rule, the weights a
sweep reads, a real measurement, the shapes the worker times, and the layouts a stage then
holds (no panels where the kernel never wins, panels only where it wins at every size)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from sarathictl.bench.random_model import write_random_llama

from stage_worker import bf16_layouts, host_memory, native
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


def test_a_sweep_reads_every_shape_then_the_first_weights_up_to_its_bytes() -> None:
    def pair(out: int) -> tuple[torch.Tensor, matmul_bf16.PackedBf16]:
        panels = torch.empty(out // 16, 32, 16, 2, dtype=torch.bfloat16)  # out * 64 * 2 bytes
        return torch.empty(0), matmul_bf16.PackedBf16(panels, out, 64)

    pairs = [pair(16), pair(32), pair(16), pair(16), pair(64)]  # 2, 4, 2, 2 and 8 KiB
    sweep = matmul_bf16_dispatch.sweep_weights
    # one of each shape whatever the bytes (the last, widest one too), then in order
    assert [p[1].out_features for p in sweep(pairs, 6 << 10)] == [16, 32, 64]
    assert [p[1].out_features for p in sweep(pairs, 15 << 10)] == [16, 32, 64, 16]
    assert len(sweep(pairs, 1 << 30)) == 5  # more than all: all


@needs_kernel
def test_a_real_measurement_times_both_at_every_count_and_says_so() -> None:
    got = matmul_bf16_dispatch.measure_shapes([(96, 64), (64, 96)], counts=(1, 4), rounds=1)
    assert got.counts == (1, 4) and len(got.kernel_ms) == len(got.onednn_ms) == 2
    assert all(t > 0 for t in got.kernel_ms + got.onednn_ms)
    assert got.max_tokens == crossover(got.counts, got.kernel_ms, got.onednn_ms)
    reach = "at every step size" if got.unbounded else f"up to {got.max_tokens} tokens"
    assert got.describe().startswith(f"bf16 matmul kernel {reach}")


def _stage(checkpoint: Path, device: str = "cpu") -> StageModel:
    """Stage 0 of 1 in bf16, loaded (device "meta": its shapes only)."""
    model_dir = str(checkpoint)
    reader = CheckpointReader(model_dir) if device != "meta" else None
    shard = ShardSpec(pp=1, tp=1, stage=0, tp_rank=0)
    model = build_stage(load_spec(model_dir), shard, TPGroup(), device, torch.bfloat16, reader)
    if reader is not None:
        reader.close()
    return model


@needs_kernel
def test_the_worker_measures_its_stages_shapes_before_it_loads(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path], reach: None
) -> None:
    checkpoint = tiny_checkpoint("llama")
    timed: list[list[tuple[int, int]]] = []
    found = Calibration((1, 16, 32), (1.0, 1.0, 1.0), (2.0, 2.0, 0.5), 16)

    def measure_shapes(shapes: list[tuple[int, int]]) -> Calibration:
        timed.append(list(shapes))
        return found

    monkeypatch.setattr(matmul_bf16_dispatch, "measure_shapes", measure_shapes)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 64 * GIB)
    shard = ShardSpec(pp=1, tp=1, stage=0, tp_rank=0)
    spec = load_spec(str(checkpoint))
    meta = _stage(checkpoint, "meta")

    def choose(dtype: torch.dtype, kv_cache_bytes: int, workers_on_host: int = 1) -> None:
        bf16_layouts.choose(spec, shard, TPGroup(), "cpu", dtype, kv_cache_bytes, workers_on_host)

    choose(torch.bfloat16, GIB)
    assert timed == [meta.linear_shapes()]  # every linear layer's, in order
    assert matmul_bf16.REACH.max_tokens == 16
    choose(torch.float32, GIB)
    assert len(timed) == 1  # nothing to measure where no weight is bf16

    # where oneDNN's copies would not fit beside the weights and the KV cache: held once,
    # in the layout that ran faster over the counts (here the kernel's: 2x, 2x and 0.5x)
    sizes = bf16_layouts.stage_bytes(meta, tied=False)
    room = sizes.once + 2 * GIB + sizes.both_extra + matmul_bf16_dispatch.MEMORY_HEADROOM_BYTES
    monkeypatch.setattr(host_memory, "available_bytes", lambda: room)
    choose(torch.bfloat16, 2 * GIB)
    assert matmul_bf16.REACH.max_tokens == 16  # just fits
    choose(torch.bfloat16, 2 * GIB, workers_on_host=2)  # half of it each: does not
    assert matmul_bf16.REACH.max_tokens == UNBOUNDED


def test_a_stage_counts_the_copies_both_layouts_hold(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    untied = _stage(tiny_checkpoint("llama"), "meta")
    linear = sum(o * i for o, i in untied.linear_shapes()) * 2
    assert untied.lm_head is not None
    head = untied.lm_head.weight.numel() * 2
    got = bf16_layouts.stage_bytes(untied, tied=False)
    # untied: the head's rows and oneDNN's copy beside its panels; tied: oneDNN's copy only
    assert got == bf16_layouts.StageBytes(untied.param_bytes, linear + 2 * head)
    assert bf16_layouts.stage_bytes(untied, tied=True).both_extra == linear + head


GIB = 1 << 30
FASTER, SLOWER = (1.0, 1.0, 1.0), (1.0, 3.0, 3.0)  # the kernel's ms against oneDNN's (2, 2, 2)


@pytest.mark.parametrize(
    ("measured", "kernel_ms", "available", "want"),
    [
        (32, FASTER, 100 * GIB, 32),  # both copies fit
        (32, FASTER, 14 * GIB + 13 * GIB + GIB, 32),  # just: weights, copies and the headroom
        (32, FASTER, 14 * GIB + 13 * GIB + GIB - 1, UNBOUNDED),  # a byte short: panels only
        (32, SLOWER, 20 * GIB, 0),  # no room, oneDNN faster over the counts: oneDNN only
        (0, SLOWER, 1, 0),  # oneDNN alone: one copy anyway
        (UNBOUNDED, FASTER, 100 * GIB, UNBOUNDED),
    ],
    ids=["room", "just-room", "no-room", "no-room-onednn", "never-faster", "every-size"],
)
def test_a_stage_whose_copies_would_not_fit_holds_its_weights_once(
    measured: int, kernel_ms: tuple[float, ...], available: int, want: int
) -> None:
    # a Mistral-7B stage's shape: 14 GiB of weights and KV cache, oneDNN's copies 13 more
    found = Calibration((1, 16, 32), kernel_ms, (2.0, 2.0, 2.0), measured)
    assert matmul_bf16_dispatch.within_memory(found, 14 * GIB, 13 * GIB, available) == want


def test_a_loss_is_measured_again_before_it_ends_the_reach(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ms per round at 1 and 4 tokens: (kernel, oneDNN); at 4 the first rounds lose, noise
    answers = {
        1: [([1.0] * 3, [2.0] * 3)],
        4: [([6.0] * 3, [5.0] * 3), ([1.0] * 3, [5.0] * 3)],
    }
    timed: list[int] = []

    def turns(runs: object, n: int, rounds: int) -> list[list[float]]:
        timed.append(n)
        kernel, other = answers[n].pop(0)
        return [kernel, other]

    monkeypatch.setattr(matmul_bf16_dispatch, "_timed_turns", turns)
    weight = torch.zeros(16, 64, dtype=torch.bfloat16)
    pairs = [(weight, matmul_bf16.PackedBf16(torch.zeros(1, 32, 16, 2), 16, 64))]
    monkeypatch.setattr(matmul_bf16, "linear", lambda x, w, *a: x)  # the warm-up calls
    monkeypatch.setattr(matmul_bf16_dispatch.onednn, "linear", lambda x, w: x)
    got = matmul_bf16_dispatch.measure(pairs, counts=(1, 4))
    assert timed == [1, 4, 4]  # the loss at 4 measured twice, the win at 1 once
    assert got.kernel_ms == (1.0, 3.5) and got.onednn_ms == (2.0, 5.0)  # medians of 6
    assert got.unbounded  # no loss over both sets: the reach runs on

    # a loss that holds ends the measurement there: 8 is not timed
    answers.update({1: [([1.0] * 3, [2.0] * 3)], 4: [([6.0] * 3, [5.0] * 3)] * 2, 8: []})
    timed.clear()
    got = matmul_bf16_dispatch.measure(pairs, counts=(1, 4, 8))
    assert timed == [1, 4, 4] and got.counts == (1, 4) and got.max_tokens == 1


@needs_kernel
@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "untied-head"])
def test_the_layouts_follow_the_measured_reach(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path, tied: bool, reach: None
) -> None:
    # tied: the head's rows are the embedding's (as the demo model's), which looks them up
    checkpoint = (
        write_random_llama(tmp_path / "tied", "tiny", torch.bfloat16)
        if tied
        else tiny_checkpoint("llama")
    )
    built: dict[str, StageModel] = {}
    for name, measured in (("never", 0), ("up-to-16", 16), ("every-size", UNBOUNDED)):
        matmul_bf16.REACH.max_tokens = measured
        built[name] = _stage(checkpoint)
    for model in built.values():
        assert model.lm_head is not None and model.embed is not None
        assert (model.lm_head.weight is model.embed.weight) == tied

    def linears(model: StageModel) -> list[ShardedLinear]:
        return [m for m in model.modules() if isinstance(m, ShardedLinear)]

    def held(model: StageModel) -> int:
        return model.param_bytes + model.kernel_copy_bytes

    never, both, once = built["never"], built["up-to-16"], built["every-size"]
    assert all(m.bf16 is None and m.weight.is_mkldnn for m in linears(never))
    assert never.lm_head is not None and never.lm_head.bf16 is None
    assert all(m.bf16 is not None and m.weight.is_mkldnn for m in linears(both))
    assert all(
        m.bf16 is not None and m.weight.data_ptr() == m.bf16.panels.data_ptr()
        for m in linears(once)
    )
    head = once.lm_head
    assert head is not None and head.bf16 is not None and head.packed is None
    # the panels are the parameters; a tied head's beside the embedding's rows
    assert once.kernel_copy_bytes == (head.bf16.panels.nbytes if tied else 0)
    assert held(once) < 0.75 * held(both) and held(never) < held(both)

    # the same products: oneDNN's (never) against the kernel's at 100 tokens
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(100, once.spec.hidden_size, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(
        linears(once)[0](hidden).float(), linears(never)[0](hidden).float(), rtol=2**-7, atol=0.01
    )
    # the kernel's float32 sums, against oneDNN's with the top ones refined
    torch.testing.assert_close(
        once.compute_logits(hidden), never.compute_logits(hidden), rtol=2**-7, atol=0.01
    )
    # the layouts are fixed at pack(): a reach set later leaves each stage computing the same
    once_logits = once.compute_logits(hidden)
    matmul_bf16.REACH.max_tokens = 16
    assert torch.equal(once.compute_logits(hidden), once_logits)  # panels only: the kernel
    torch.testing.assert_close(
        linears(both)[0](hidden).float(), linears(never)[0](hidden).float(), rtol=2**-7, atol=0.01
    )  # both layouts: 100 tokens on oneDNN, past the reach
    token_ids = torch.tensor([0, 5, once.spec.vocab_size - 1])
    assert once.embed is not None and never.embed is not None
    assert torch.equal(once.embed(token_ids), never.embed(token_ids))
