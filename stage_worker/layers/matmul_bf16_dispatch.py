"""Up to how many tokens a step's bf16 matmuls run the package's kernel (matmul_bf16.py) rather
than oneDNN on this CPU: measured once, when a worker has loaded its weights.

Why measure rather than fix a number: on the Zen 5 EPYC (AVX512-BF16, no AMX) the kernel is the
faster one up to about 96 tokens (BENCHMARKS "A bf16 matmul for decode steps"), and 64 is the
default. A Xeon with AMX runs oneDNN's bf16 matmuls on its tile unit, several times the
arithmetic of the vdpbf16ps the kernel issues, so there oneDNN may win from a few tokens on; no
session has measured one since the kernel was written. The worker therefore times both, each
over enough of its own weights to stream them from memory as a step does, at the token counts
of COUNTS, and keeps the kernel up to the last count before its first clear loss (LOSS_MARGIN:
a median of 3 on a shared machine moves by a few percent; AMX should lead by a factor, not by
noise). Where the kernel lost at no count, up to the largest step a budget allows here, its
reach is unbounded and the stage's bf16 weights are packed as panels only: on the Zen 5 EPYC
it ran at 0.98x-1.68x oneDNN's speed over the counts, so they take half the memory there. The
worker measures before it loads (measure_shapes), so the layouts the stage holds are the ones
it chose. The layers' reach also serves the LM head, whose rows are a decode step's sequences.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stage_worker.layers import matmul_bf16, onednn

COUNTS = (1, 8, 16, 32, 48, 64, 128, 256, 512)
"""The token counts measured: decode steps, then chunks up to the largest budget `up` fits
(tools/sarathictl/budget_fit.py). Past 128 tokens both kernels are bound by the arithmetic, so
a win at 512 stands for larger steps too."""

LOSS_MARGIN = 1.05
"""The kernel loses a count where its median time exceeds oneDNN's by more than this factor."""

SWEEP_BYTES = 256 << 20
"""Weights a timed sweep of up to STREAMED_UP_TO tokens reads (the model's first ones, or all
where it holds fewer): more than any last-level cache of the CPUs measured, so both kernels
read from memory."""

STREAMED_UP_TO = 64
"""Past this many tokens a sweep reads SWEEP_BYTES * STREAMED_UP_TO / tokens of weights: the
product is bound by the arithmetic there, and each count then costs what one of 64 does."""

ROUNDS = 3
"""Sweeps per kernel and count; the median is kept, the kernels taking turns."""


@dataclass(frozen=True)
class Calibration:
    """What was measured and what it chose (the worker logs `describe()`)."""

    counts: tuple[int, ...]
    kernel_ms: tuple[float, ...]
    onednn_ms: tuple[float, ...]
    max_tokens: int

    @property
    def unbounded(self) -> bool:
        """Whether the kernel takes every step (no weight needs oneDNN's layout)."""
        return self.max_tokens == matmul_bf16.UNBOUNDED

    def describe(self) -> str:
        ratios = ", ".join(
            f"{n}: {o / k:.2f}x"
            for n, k, o in zip(self.counts, self.kernel_ms, self.onednn_ms, strict=True)
        )
        reach = (
            "at every step size, each bf16 weight held once, as its panels"
            if self.unbounded
            else f"up to {self.max_tokens} tokens, oneDNN past them"
        )
        return (
            f"bf16 matmul kernel {reach} (its speed over oneDNN's by tokens, measured at load: "
            f"{ratios})"
        )


def loses(kernel_ms: float, onednn_ms: float) -> bool:
    """Whether the kernel lost a count: LOSS_MARGIN times slower than oneDNN or more."""
    return kernel_ms > LOSS_MARGIN * onednn_ms


def crossover(counts: Sequence[int], kernel_ms: Sequence[float], onednn_ms: Sequence[float]) -> int:
    """The largest of `counts` (ascending) up to which the kernel lost at no count; 0 where it
    lost at the first, matmul_bf16.UNBOUNDED where it lost at none."""
    reach = 0
    for n, kernel, other in zip(counts, kernel_ms, onednn_ms, strict=True):
        if loses(kernel, other):
            return reach
        reach = n
    return matmul_bf16.UNBOUNDED


Weights = list[tuple[torch.Tensor, matmul_bf16.PackedBf16]]
"""(the weight as oneDNN reads it, the same weight's panels)."""


def sweep_bytes(tokens: int) -> int:
    """Weight bytes a sweep of `tokens` reads (SWEEP_BYTES, STREAMED_UP_TO)."""
    return SWEEP_BYTES * min(tokens, STREAMED_UP_TO) // tokens


def _shape(pair: tuple[torch.Tensor, matmul_bf16.PackedBf16]) -> tuple[int, int]:
    return pair[1].out_features, pair[1].in_features


def sweep_weights(pairs: Weights, size: int = SWEEP_BYTES) -> Weights:
    """One of each shape in `pairs` (in order: a 7B model's down projection, the widest input,
    must be timed too), then the others in order until their panels add up to `size` bytes."""
    first_of: dict[tuple[int, int], int] = {}  # shape -> index of its first pair
    for i, pair in enumerate(pairs):
        first_of.setdefault(_shape(pair), i)
    firsts = set(first_of.values())
    taken = [pairs[i] for i in first_of.values()]
    total = sum(packed.panels.nbytes for _, packed in taken)
    for i, pair in enumerate(pairs):
        if total >= size:
            break
        if i not in firsts:
            taken.append(pair)
            total += pair[1].panels.nbytes
    return taken


def measure(pairs: Weights, counts: Sequence[int] = COUNTS, rounds: int = ROUNDS) -> Calibration:
    """Each count's median sweep time over `pairs` (sweep_weights: one of each shape, then up
    to sweep_bytes(count)) on the kernel and on oneDNN, up to the first loss, and the
    crossover. pairs: non-empty; the inputs are random bf16 rows, [count, in] per weight."""
    if not pairs or not counts:
        raise ValueError("nothing to measure: no weights or no token counts")
    widths = {packed.in_features for _, packed in pairs}
    rows = {w: torch.randn(max(counts), w).to(torch.bfloat16) for w in widths}  # [n, in]
    weights: Weights = []

    def kernel(n: int) -> None:
        for _, packed in weights:
            matmul_bf16.linear(rows[packed.in_features][:n], packed)

    def other(n: int) -> None:
        for weight, packed in weights:
            onednn.linear(rows[packed.in_features][:n], weight)

    kernel_ms: list[float] = []
    onednn_ms: list[float] = []
    for n in counts:
        weights = sweep_weights(pairs, sweep_bytes(n))
        kernel(n)  # warm: first touches, and oneDNN's primitive for this shape
        other(n)
        mine, theirs = _timed_turns((kernel, other), n, rounds)
        if loses(statistics.median(mine), statistics.median(theirs)):
            # A loss ends the reach, so it must be real: measured again, over both sets of
            # rounds (the controller starting beside a worker once cost the kernel 12% at 48
            # tokens here, between wins of 1% to 11% on either side).
            more_mine, more_theirs = _timed_turns((kernel, other), n, rounds)
            mine, theirs = mine + more_mine, theirs + more_theirs
        kernel_ms.append(statistics.median(mine))
        onednn_ms.append(statistics.median(theirs))
        if loses(kernel_ms[-1], onednn_ms[-1]):
            break  # the reach ends here; the counts past it are not timed
    timed = tuple(counts[: len(kernel_ms)])
    reach = crossover(timed, kernel_ms, onednn_ms)
    return Calibration(timed, tuple(kernel_ms), tuple(onednn_ms), reach)


MEMORY_HEADROOM_BYTES = 1 << 30
"""Memory a stage leaves free beside its weights and KV cache when it judges whether oneDNN's
copies fit (activations, the runtime, the controller on the same machine)."""


def within_memory(
    calibration: Calibration, needed_bytes: int, copy_bytes: int, available_bytes: int
) -> int:
    """The reach to run: the measured one where oneDNN's copies (copy_bytes more) fit beside
    what the stage needs anyway (needed_bytes: its weights held once and its KV cache) in the
    memory available, with MEMORY_HEADROOM_BYTES to spare; else one layout, whichever ran
    faster over the counts measured (the geometric mean of the ratios: each count alike):
    UNBOUNDED (panels only) or 0 (oneDNN only). A stage somewhat slower at some step sizes
    beats one the system's out-of-memory killer ended while it loaded: a Mistral-7B stage on
    24 GiB is 14 GiB of weights, and both layouts 27."""
    measured = calibration.max_tokens
    if measured in (0, matmul_bf16.UNBOUNDED):
        return measured  # one copy either way
    if needed_bytes + copy_bytes + MEMORY_HEADROOM_BYTES <= available_bytes:
        return measured
    ratios = [o / k for k, o in zip(calibration.kernel_ms, calibration.onednn_ms, strict=True)]
    return matmul_bf16.UNBOUNDED if statistics.geometric_mean(ratios) >= 1.0 else 0


def measure_shapes(
    shapes: Sequence[tuple[int, int]], counts: Sequence[int] = COUNTS, rounds: int = ROUNDS
) -> Calibration:
    """measure() over stand-in weights of these [out, in] shapes (a stage's linear layers in
    order: one of each shape, then the first SWEEP_BYTES of them), in both layouts: taken
    before the stage loads, so that each weight is packed once, in the layouts the measurement
    chose, and a stage whose weights the kernel takes alone never holds two copies. The values
    are a constant: neither kernel's time depends on them (a fill costs what a copy does,
    random numbers seconds)."""
    wanted = list(dict.fromkeys(shapes))  # one of each shape first: sweep_weights times all
    total = sum(out * in_ * 2 for out, in_ in wanted)
    for shape in shapes:  # then the stage's order, up to SWEEP_BYTES
        if total >= SWEEP_BYTES:
            break
        wanted.append(shape)
        total += shape[0] * shape[1] * 2
    pairs: Weights = []
    for out, in_ in wanted:
        weight = torch.full((out, in_), 0.01, dtype=torch.bfloat16)
        packed = matmul_bf16.pack(weight)
        pairs.append((onednn.pack(weight) if onednn.can_pack(weight) else weight, packed))
    return measure(pairs, counts, rounds)


def _timed_turns(runs: tuple[Callable[[int], None], ...], n: int, rounds: int) -> list[list[float]]:
    """Each run's ms in each of `rounds`, the runs taking turns (first one first, then last
    one first: a drift weighs on both alike)."""
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        order = range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            start = time.perf_counter()
            runs[i](n)
            times[i].append((time.perf_counter() - start) * 1e3)
    return times
