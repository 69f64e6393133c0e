"""stage_worker._kernels, the C kernels built with the package: it is in this install, imports on
any x86-64 CPU (the kernels alone are compiled for AVX-512), and refuses every argument it would
read out of bounds, naming it, before it looks at the CPU. These checks run on every machine,
the kernels' numbers only where the CPU runs them (test_cpu_attention_kernel.py)."""

from __future__ import annotations

import platform
from collections.abc import Callable

import pytest
import torch

from stage_worker import native
from stage_worker.attention import cpu_kernel

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the kernels are built for x86-64 only"
)


def kernels() -> object:
    from stage_worker import _kernels  # type: ignore[attr-defined]

    return _kernels


def test_the_module_is_built_with_openmp_and_says_whether_this_cpu_runs_it() -> None:
    module = kernels()
    assert module.openmp()  # type: ignore[attr-defined]
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    runs = all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"))
    assert module.cpu_supported() == runs  # type: ignore[attr-defined]
    assert (native.kernels() is not None) == runs


SCRATCH_FLOATS = cpu_kernel.scratch_floats(4, 2, 20, 1)
"""What _attention_args' call needs, as the module reports it: its check takes exactly that."""


def _attention_args(**change: torch.Tensor) -> dict[str, torch.Tensor]:
    """Arguments the kernel takes: 2 tokens, 4 query heads over 2 KV heads of 64."""
    args = {
        "q": torch.zeros(2, 4, 64, dtype=torch.bfloat16),
        "k_cache": torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
        "v_cache": torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
        "block_table": torch.tensor([[2, 0], [1, 0]]),
        "context_lens": torch.tensor([20, 3]),
        "scratch": torch.zeros(SCRATCH_FLOATS),
        "out": torch.zeros(2, 4, 64, dtype=torch.bfloat16),
    }
    args.update(change)
    return args


def _call_attention(args: dict[str, torch.Tensor]) -> None:
    module = kernels()
    module.paged_attention(*(native.capsule(t) for t in args.values()), 0.125, 1)  # type: ignore[attr-defined]


BAD_ATTENTION: list[tuple[str, dict[str, torch.Tensor]]] = [
    ("k_cache: dtype differs from q's", {"k_cache": torch.zeros(3, 16, 2, 64)}),
    ("q: dtype must be bfloat16 or float32", {"q": torch.zeros(2, 4, 64, dtype=torch.float16)}),
    ("block_table: dtype must be int64", {"block_table": torch.tensor([[2, 0], [1, 0]]).int()}),
    ("block_table: names a block outside", {"block_table": torch.tensor([[2, 3], [1, 0]])}),
    ("block_table: names a block outside", {"block_table": torch.tensor([[2, 0], [-1, 0]])}),
    ("context_lens: each must be >= 1", {"context_lens": torch.tensor([33, 3])}),
    ("context_lens: each must be >= 1", {"context_lens": torch.tensor([20, 0])}),
    ("scratch: too small", {"scratch": torch.zeros(SCRATCH_FLOATS - 1)}),
    ("scratch: dtype must be float32", {"scratch": torch.zeros(64, dtype=torch.bfloat16)}),
    ("q: must be contiguous", {"q": torch.zeros(4, 2, 64, dtype=torch.bfloat16).transpose(0, 1)}),
    ("q: 2 dimensions, expected 3", {"q": torch.zeros(2, 256, dtype=torch.bfloat16)}),
    ("q: head_dim must be a multiple of 16", {
        "q": torch.zeros(2, 4, 40, dtype=torch.bfloat16),
        "k_cache": torch.zeros(3, 16, 2, 40, dtype=torch.bfloat16),
        "v_cache": torch.zeros(3, 16, 2, 40, dtype=torch.bfloat16),
        "out": torch.zeros(2, 4, 40, dtype=torch.bfloat16),
    }),
    ("q: query heads must be 1 to 64 times", {
        "q": torch.zeros(2, 3, 64, dtype=torch.bfloat16),
        "out": torch.zeros(2, 3, 64, dtype=torch.bfloat16),
    }),
    ("out: shape differs from q's", {"out": torch.zeros(2, 4, 32, dtype=torch.bfloat16)}),
    ("v_cache: shape differs", {"v_cache": torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)}),
    ("block_table: needs one row", {"block_table": torch.tensor([[2, 0]])}),
]  # fmt: skip


@pytest.mark.parametrize(("message", "change"), BAD_ATTENTION)
def test_attention_refuses_what_it_would_read_out_of_bounds(
    message: str, change: dict[str, torch.Tensor]
) -> None:
    with pytest.raises(ValueError, match=message):
        _call_attention(_attention_args(**change))


def test_the_scratch_size_is_one_tile_of_a_chunks_scores_and_bad_heads_are_named() -> None:
    # 3 query heads a KV head: tiles of 8 tokens, 24 score rows of the context rounded to 16
    assert cpu_kernel.scratch_floats(9, 3, 20, 2) == 2 * 24 * 32
    assert cpu_kernel.scratch_floats(29, 1, 16, 1) == 29 * 16  # a group past a tile: one token
    with pytest.raises(ValueError, match="num_q_heads"):
        cpu_kernel.scratch_floats(9, 2, 20, 1)


def test_good_attention_arguments_pass_every_check() -> None:
    """The same call with nothing wrong runs (bf16 caches: AVX-512 CPUs) or is refused for the
    CPU alone; float32 caches run on AVX2 with FMA too."""
    module = kernels()
    if module.cpu_supported():  # type: ignore[attr-defined]
        _call_attention(_attention_args())
    else:
        with pytest.raises(RuntimeError, match="neither AVX-512 with bf16 nor"):
            _call_attention(_attention_args())
    float32 = {k: v.float() for k, v in _attention_args().items() if v.is_floating_point()}
    if module.fused_supported():  # type: ignore[attr-defined]
        _call_attention(_attention_args(**float32))


def test_a_used_or_foreign_object_is_refused() -> None:
    module = kernels()
    with pytest.raises(ValueError, match="q: expected an unused DLPack capsule"):
        module.paged_attention(object(), *[None] * 6, 0.1, 1)  # type: ignore[attr-defined]


GEMV_BAD: list[tuple[str, Callable[[], tuple[torch.Tensor, ...]]]] = [
    ("must all be bfloat16", lambda: (torch.zeros(1, 64), torch.zeros(8, 64), torch.zeros(1, 8))),
    ("weight: its inputs differ", lambda: (
        torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16),
        torch.zeros(1, 8, dtype=torch.bfloat16))),
    ("out: must be", lambda: (
        torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16),
        torch.zeros(1, 8, dtype=torch.bfloat16))),
]  # fmt: skip


@pytest.mark.parametrize(("message", "make"), GEMV_BAD)
def test_gemv_refuses_mismatched_shapes_and_dtypes(
    message: str, make: Callable[[], tuple[torch.Tensor, ...]]
) -> None:
    module = kernels()
    with pytest.raises(ValueError, match=message):
        module.gemv_bf16(*(native.capsule(t) for t in make()))  # type: ignore[attr-defined]
