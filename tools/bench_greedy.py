"""The last stage's greedy pick on this CPU: torch.argmax against the sampler's blocked argmax
(stage_worker.sampler.greedy_tokens), one thread, float32 logits over SmolLM2's vocabulary.
Medians of 50 calls, in ms. `python tools/bench_greedy.py` (BENCHMARKS.md, issue 30)."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from stage_worker.sampler import greedy_tokens

VOCAB = 49152


def median_ms(fn: Callable[[], object], calls: int = 50) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return names[0] if names else platform.processor()


def main() -> None:
    torch.set_num_threads(1)
    print(f"{cpu_model()}, torch {torch.__version__}, 1 thread, vocabulary {VOCAB}")
    print("rows  torch.argmax  greedy_tokens")
    for rows in (1, 8, 32, 128):
        logits = torch.randn(rows, VOCAB)
        plain = median_ms(lambda: logits.argmax(dim=-1).tolist())  # noqa: B023
        blocked = median_ms(lambda: greedy_tokens(logits))  # noqa: B023
        print(f"{rows:>4}  {plain:>12.3f}  {blocked:>13.3f}")


if __name__ == "__main__":
    main()
