"""TPOT, P99 TBT and TTFT against request rate for both systems: a row of panels per workload."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

from bench_vs_vllm.results import Row

STYLES = {
    "vllm": ("tab:blue", "o"),
    "sarathi": ("tab:red", "s"),
    "sarathi-budget": ("tab:orange", "D"),
    "sarathi-pp": ("tab:purple", "v"),
    "vllm-pp": ("tab:green", "o"),
}


def _style(system: str) -> tuple[str, str]:
    """A system's colour and marker; `sarathi-budget<N>` share one, and so do `*-pp<N>`."""
    return STYLES.get(system.rstrip("0123456789"), ("tab:gray", "^"))


def _x(rate: float, finite_max: float) -> float:
    """`inf` drawn one step past the highest finite rate."""
    return finite_max * 1.4 if math.isinf(rate) else rate


def _curves(runs: list[Row], panel: str) -> list[tuple[str, list[float]]]:
    """(line style, values) for one panel: TPOT and TTFT show p50 and p99, TBT its p99."""
    if panel == "TPOT":
        return [("-", [r.median_tpot_ms for r in runs]), ("--", [r.p99_tpot_ms for r in runs])]
    if panel == "TTFT":
        return [("-", [r.median_ttft_ms for r in runs]), ("--", [r.p99_ttft_ms for r in runs])]
    return [("--", [r.p99_itl_ms for r in runs])]


def plot(rows: list[Row], out: Path, slos_ms: dict[str, float] | None = None) -> None:
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    ticker: Any = importlib.import_module("matplotlib.ticker")
    panels = ("TPOT", "P99 TBT", "TTFT")
    workloads = sorted({r.workload for r in rows})
    fig, axes = plt.subplots(
        len(workloads), len(panels), figsize=(13, 3.3 * len(workloads)), squeeze=False, dpi=72
    )
    for row_axes, workload in zip(axes, workloads, strict=True):
        mine = [r for r in rows if r.workload == workload]
        finite_max = max((r.rate for r in mine if math.isfinite(r.rate)), default=1.0)
        ticks = sorted({r.rate for r in mine}, key=lambda v: (math.isinf(v), v))
        for ax, panel in zip(row_axes, panels, strict=True):
            for system in sorted({r.system for r in mine}):
                color, marker = _style(system)
                runs = sorted((r for r in mine if r.system == system), key=lambda r: r.rate)
                xs = [_x(r.rate, finite_max) for r in runs]
                for style, ys in _curves(runs, panel):
                    label = f"{system} {'p50' if style == '-' else 'p99'}"
                    ax.plot(xs, ys, color=color, marker=marker, ls=style, label=label)
            if panel == "P99 TBT":
                for name, value in (slos_ms or {}).items():
                    ax.axhline(value, color="gray", lw=0.8, ls=":")
                    ax.annotate(f"SLO {name.split()[0]}", (xs[0], value), fontsize=7)
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_xticks([_x(t, finite_max) for t in ticks])
            ax.set_xticklabels(["inf" if math.isinf(t) else f"{t:g}" for t in ticks])
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(f"{panel} ms")
            ax.set_title(f"{workload}: {panel}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
