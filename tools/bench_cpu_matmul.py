"""One pipeline stage's float32 linear layers on this CPU: torch's F.linear (MKL), oneDNN's
packed matmul (what a worker with several threads used before) and the package's AVX2 kernel
(layers/cpu_matmul.py).

    python tools/bench_cpu_matmul.py [--threads 1] [--tokens 1,2,4,8,16,64,128] [--layers 15]
        [--baseline OTHER/stage_worker/_kernels.cpython-311-x86_64-linux-gnu.so] [--no-torch]
        [--bf16-values]

--baseline adds another build of the C module (say, the last commit's, built in a copy of the
tree with `python setup.py build_ext --inplace`) as a path of its own on the same packed
weights, so that a change to the kernel is timed against the kernel before it in one process,
the two alternated; each token count checks first that both give the same outputs.

--bf16-values rounds the weights to bf16 values (a bf16 checkpoint served in float32), which the
kernel then holds as bf16 panels; the float32 panels of the same weights run beside it, and the
baseline build (which may predate bf16 panels) gets those.

Shapes are the demo model's (SmolLM2-135M: QKV 576 -> 960, O 576 -> 576, gate-up 576 -> 3,072,
down 1,536 -> 576), 15 layers by default: half the model, one stage of the default PP=2. Prints
the median milliseconds over all of them per step, the three paths alternated in rounds so that
a noisy machine loads all alike, with the weight bytes over the time (GB/s) for the kernel.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from stage_worker import native
from stage_worker.layers import cpu_matmul, onednn

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
"""[out, in] of one demo-model layer's four matmuls."""


BASELINE = "baseline build"
MKL = "F.linear (MKL)"


def load_build(path: Path) -> ModuleType:
    """Another build of stage_worker._kernels, loaded beside this one under a name of its own."""
    name = "baseline._kernels"  # the last part names its init function: PyInit__kernels
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


KERNEL = "AVX2 kernel"
FLOAT32_PANELS = "float32 panels"


def random_weight(out: int, in_: int, bf16_values: bool) -> torch.Tensor:
    weight = torch.randn(out, in_) * 0.02  # [out, in]
    return weight.bfloat16().float() if bf16_values else weight


def paths(
    layers: int,
    baseline: ModuleType | None = None,
    torch_paths: bool = True,
    bf16_values: bool = False,
) -> tuple[int, dict[str, Callable[[dict[int, torch.Tensor]], None]]]:
    """The weights' bytes as the kernel reads them and, per path, a closure running every
    layer's matmuls on inputs keyed by their width."""
    plain = [random_weight(o, i, bf16_values) for _ in range(layers) for o, i in SHAPES]
    packed = [cpu_matmul.pack(w) for w in plain]
    float32 = [cpu_matmul.pack(w, bf16_where_exact=False) for w in plain] if bf16_values else packed
    blocked = [onednn.pack(w) for w in plain]

    def mkl(xs: dict[int, torch.Tensor]) -> None:
        for w in plain:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    def one_dnn(xs: dict[int, torch.Tensor]) -> None:
        for w, b in zip(plain, blocked, strict=True):
            onednn.linear(xs[w.shape[1]], b)

    def kernel_on(
        panels: list[cpu_matmul.PackedWeight],
    ) -> Callable[[dict[int, torch.Tensor]], None]:
        def run(xs: dict[int, torch.Tensor]) -> None:
            for w, p in zip(plain, panels, strict=True):
                cpu_matmul.linear(xs[w.shape[1]], p)

        return run

    nbytes = sum(p.panels.nbytes for p in packed)
    runs: dict[str, Callable[[dict[int, torch.Tensor]], None]] = {KERNEL: kernel_on(packed)}
    if torch_paths:
        runs = {MKL: mkl, "oneDNN packed": one_dnn, **runs}
    if bf16_values:
        runs[FLOAT32_PANELS] = kernel_on(float32)
    if baseline is not None:

        def other_build(xs: dict[int, torch.Tensor]) -> None:
            baseline_run(baseline, float32, xs)

        runs[BASELINE] = other_build
    return nbytes, runs


def baseline_run(
    module: ModuleType, packed: list[cpu_matmul.PackedWeight], xs: dict[int, torch.Tensor]
) -> list[torch.Tensor]:
    """cpu_matmul.linear's call, on the other build."""
    outs = []
    for w in packed:
        x = xs[w.panels.shape[1]]  # panels: [n / 16, in, 16]
        y = torch.empty(x.shape[0], w.out_features)
        module.sgemm_f32(
            native.capsule(x), native.capsule(w.panels), native.capsule(y), torch.get_num_threads()
        )
        outs.append(y)
    return outs


def check_same_outputs(module: ModuleType, tokens: int, bf16_values: bool) -> None:
    """The two builds agree bit for bit on one layer's matmuls (a timing of a wrong kernel
    is no measurement), the baseline on float32 panels."""
    plain = [random_weight(out, in_, bf16_values) for out, in_ in SHAPES]
    weights = [cpu_matmul.pack(w) for w in plain]
    float32 = [cpu_matmul.pack(w, bf16_where_exact=False) for w in plain]
    xs = {in_: torch.randn(tokens, in_) for in_ in {s[1] for s in SHAPES}}
    for w, theirs in zip(weights, baseline_run(module, float32, xs), strict=True):
        ours = cpu_matmul.linear(xs[w.panels.shape[1]], w)
        if not torch.equal(ours, theirs):
            raise SystemExit(f"the baseline build's outputs differ at {tokens} tokens")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", default="1,2,4,8,16,64,128")
    p.add_argument("--layers", type=int, default=15)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--baseline",
        type=Path,
        help="another build's stage_worker/_kernels*.so, timed beside this one",
    )
    p.add_argument(
        "--no-torch",
        action="store_true",
        help="leave out MKL and oneDNN (their threads, spinning after a call, load the cores "
        "the next path runs on): the cleaner A/B of two kernel builds",
    )
    p.add_argument(
        "--bf16-values",
        action="store_true",
        help="weights rounded to bf16 values, which the kernel holds as bf16 panels; their "
        "float32 panels run beside it",
    )
    args = p.parse_args(argv)
    if not cpu_matmul.usable_for(torch.empty(1, 1)):
        print("the AVX2 kernel cannot run here (no AVX2 with FMA, or no C module)")
        return 1
    torch.set_num_threads(args.threads)
    baseline = load_build(args.baseline) if args.baseline else None
    nbytes, runs = paths(args.layers, baseline, not args.no_torch, args.bf16_values)
    others = [name for name in (MKL, FLOAT32_PANELS, BASELINE) if name in runs]
    ratios = [f"{name} / kernel" for name in others]
    held = "bf16 panels" if args.bf16_values else "float32"
    print(f"{nbytes / 1e6:.0f} MB of weights ({held}), {args.threads} thread(s)")
    print("| tokens | " + " | ".join(f"{n} ms" for n in runs) + " | kernel GB/s | "
          + " | ".join(ratios) + " |")  # fmt: skip
    print("| ---: |" + " ---: |" * (len(runs) + 1 + len(ratios)))
    for tokens in (int(t) for t in args.tokens.split(",")):
        if baseline is not None:
            check_same_outputs(baseline, tokens, args.bf16_values)
        xs = {in_: torch.randn(tokens, in_) for in_ in {s[1] for s in SHAPES}}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for round_index in range(args.rounds):
            # Every other round in the reverse order: no path always follows the same one (the
            # one before leaves the caches and the threads in its own state).
            order = list(runs.items())
            for name, run in order if round_index % 2 == 0 else reversed(order):
                run(xs)  # warm
                start = time.perf_counter()
                run(xs)
                times[name].append((time.perf_counter() - start) * 1e3)
        ms = {name: statistics.median(t) for name, t in times.items()}
        kernel = ms[KERNEL]
        cells = " | ".join(f"{v:.1f}" for v in ms.values())
        speedups = [ms[name] / kernel for name in others]
        ratio_cells = " | ".join(f"{r:.2f}x" for r in speedups)
        print(f"| {tokens} | {cells} | {nbytes / kernel / 1e6:.1f} | {ratio_cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
