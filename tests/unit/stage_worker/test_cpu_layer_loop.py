"""The layer loop (stage_worker/models/llama_cpu_loop.py) takes every step of a float32 or
bf16 Llama stage on a CPU with the C kernels and computes what the layers' modules compute, bit
for bit: the same logits at every sampled position and the same KV cache, over prompts chunked
beside other requests' decodes; and it stands aside wherever it does not apply."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from stage_worker import native
from stage_worker.layers import cpu_matmul, fused, gemv, matmul_bf16
from stage_worker.layers.linear import ShardedLinear
from stage_worker.models import llama_cpu_loop
from stage_worker.models.llama import LlamaStage
from stage_worker.models.llama_cpu_loop import CpuLayerLoop
from stage_worker.runner import StageRunner
from tests.conftest import REPO_ROOT
from tests.unit.stage_worker.inprocess import generate, make_runners
from tests.unit.stage_worker.test_matches_transformers import make_prompts

pytestmark = pytest.mark.skipif(
    native.fused_kernels() is None, reason="the C kernels do not run here (x86-64 AVX2 + FMA)"
)

# Chunked by a budget of 32 beside the other requests' decodes: mixed steps, then decodes. At
# budget 128 and PP=2 their 168 tokens spread over both micro-batches still make steps of 80,
# past the bf16 kernel's default reach of 64.
PROMPT_LENGTHS = (37, 5, 70, 16, 40)


def stage_model(runner: StageRunner) -> LlamaStage:
    assert isinstance(runner.model, LlamaStage)
    return runner.model


@pytest.fixture
def loop_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of every step the loop ran."""
    calls: list[int] = []
    forward = CpuLayerLoop.forward

    def counted(self: CpuLayerLoop, hidden: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return forward(self, hidden, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(CpuLayerLoop, "forward", counted)
    return calls


BF16_MARKS = pytest.mark.skipif(
    native.kernels() is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="bf16 attention kernel (AVX-512 with bf16) or oneDNN bf16 missing here",
)


DEFAULT_REACH = matmul_bf16.MAX_TOKENS


@pytest.mark.parametrize(
    ("dtype", "silu_in_matmul", "budget", "matmul_kernel", "reach"),
    [
        pytest.param(torch.float32, True, 32, True, DEFAULT_REACH, id="float32-silu-in-matmul"),
        pytest.param(torch.float32, False, 32, True, DEFAULT_REACH, id="float32-silu-pass"),
        pytest.param(
            torch.bfloat16, False, 32, True, DEFAULT_REACH, id="bfloat16", marks=BF16_MARKS
        ),
        # steps past matmul_bf16.REACH: their matmuls on oneDNN, the decodes' on the kernel
        pytest.param(
            torch.bfloat16, False, 128, True, DEFAULT_REACH, id="bfloat16-budget-128",
            marks=BF16_MARKS,
        ),
        # a reach measured unbounded: every weight held as panels only, every step the kernel's
        pytest.param(
            torch.bfloat16, False, 128, True, matmul_bf16.UNBOUNDED, id="bfloat16-panels-only",
            marks=BF16_MARKS,
        ),
        # --no-cpu-matmul-kernel: every bf16 matmul on oneDNN, the loop still taking the steps
        pytest.param(
            torch.bfloat16, False, 32, False, DEFAULT_REACH, id="bfloat16-onednn",
            marks=BF16_MARKS,
        ),
    ],
)  # fmt: skip
@pytest.mark.parametrize("pp", [1, 2])
def test_the_loop_takes_every_step_and_matches_the_modules(
    pp: int,
    dtype: torch.dtype,
    silu_in_matmul: bool,
    budget: int,
    matmul_kernel: bool,
    reach: int,
    tiny_checkpoint: Callable[[str], Path],
    loop_calls: list[int],
) -> None:
    cpu_matmul.set_enabled(matmul_kernel)  # decides the layers loaded below
    matmul_bf16.REACH.max_tokens = reach  # as a worker measured it, before loading
    try:
        _the_loop_matches_the_modules(
            pp, dtype, silu_in_matmul, budget, tiny_checkpoint, loop_calls
        )
    finally:
        cpu_matmul.set_enabled(True)
        matmul_bf16.REACH.max_tokens = DEFAULT_REACH


def _the_loop_matches_the_modules(
    pp: int,
    dtype: torch.dtype,
    silu_in_matmul: bool,
    budget: int,
    tiny_checkpoint: Callable[[str], Path],
    loop_calls: list[int],
) -> None:
    model_dir = tiny_checkpoint("llama")
    prompts = make_prompts(PROMPT_LENGTHS)
    modules = make_runners(model_dir, pp, 32, dtype=dtype)
    for runner in modules:
        stage_model(runner).layer_loop = None
    expected = generate(modules, prompts, max_tokens=6, budget_tokens=budget)
    assert not loop_calls

    looped = make_runners(model_dir, pp, 32, dtype=dtype)
    for runner in looped:
        loop = stage_model(runner).layer_loop
        assert loop is not None
        matmuls = loop.matmuls
        if isinstance(matmuls, llama_cpu_loop._Float32Matmuls):
            assert matmuls.silu_in_matmul  # the tiny model's F = 96: whole panels of 16
            matmuls.silu_in_matmul = silu_in_matmul  # the pass of its own, as where F is not
        else:
            assert dtype == torch.bfloat16 and not matmuls.silu_in_matmul
            layers = [m for m in runner.model.modules() if isinstance(m, ShardedLinear)]
            panels_only = matmul_bf16.REACH.takes_every_step() and cpu_matmul.enabled()
            assert all(m.panels_only == panels_only for m in layers)
    got = generate(looped, prompts, max_tokens=6, budget_tokens=budget)
    if budget > matmul_bf16.REACH.max_tokens:
        assert max(loop_calls) > matmul_bf16.REACH.max_tokens

    assert len(loop_calls) == got.num_batches * pp  # every step of every stage
    # chunks beside decodes, then decodes only (at 32, one request's alone at the end)
    assert max(loop_calls) > 1 and min(loop_calls) <= (1 if budget == 32 else len(prompts))
    assert got.tokens == expected.tokens
    for seq_id, rows in expected.last_logits.items():
        assert len(got.last_logits[seq_id]) == len(rows)
        for want, have in zip(rows, got.last_logits[seq_id], strict=True):
            assert torch.equal(have, want)
    for a, b in zip(modules, looped, strict=True):
        assert torch.equal(a.kv_cache.data, b.kv_cache.data)


@pytest.fixture
def switch_back() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    llama_cpu_loop.set_enabled(True)
    cpu_matmul.set_enabled(True)
    fused.set_enabled(True)
    gemv._enabled = False
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("switch_back")
@pytest.mark.parametrize(
    "why",
    [
        "float16",
        "--no-cpu-layer-loop",
        "--no-cpu-matmul-kernel",
        "--no-fused-ops",
        pytest.param("--small-batch-kernel --no-cpu-matmul-kernel", marks=BF16_MARKS),
    ],
)
def test_the_modules_run_where_the_loop_does_not_apply(
    why: str, tiny_checkpoint: Callable[[str], Path], loop_calls: list[int]
) -> None:
    small_batch = why.startswith("--small-batch-kernel")
    dtype = torch.bfloat16 if small_batch else torch.float16 if why == "float16" else torch.float32
    llama_cpu_loop.set_enabled(why != "--no-cpu-layer-loop")
    cpu_matmul.set_enabled(not why.endswith("--no-cpu-matmul-kernel"))
    fused.set_enabled(why != "--no-fused-ops")
    if small_batch:  # the GEMV kernel reads the plain weights: one thread, the bf16 kernel off
        gemv.enable()
        torch.set_num_threads(1)
    runners = make_runners(tiny_checkpoint("llama"), 1, 32, dtype=dtype)
    built = stage_model(runners[0]).layer_loop is not None
    assert built == (why == "--no-fused-ops")  # that one is decided at every step
    out = generate(runners, make_prompts((21, 3)), max_tokens=3)
    assert not loop_calls
    assert all(len(tokens) == 3 for tokens in out.tokens.values())


def test_its_benchmark_prints_a_row_per_point(
    tiny_checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """tools/bench_cpu_layer_loop.py, which BENCHMARKS.md quotes (tiny points: not a
    measurement)."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))  # a script there, not installed
    import bench_cpu_layer_loop

    model = str(tiny_checkpoint("llama"))
    argv = ["--model", model, "--decodes", "1,3", "--prefills", "9", "--context-tokens", "20"]
    assert bench_cpu_layer_loop.main([*argv, "--rounds", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[:3] for row in rows[1:]] == [
        ["| decode", "1", "yes"],
        ["| decode", "3", "yes"],
        ["| prefill", "9", "yes"],
    ]
