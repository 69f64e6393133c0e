"""The bench-paper section of BENCHMARKS.md, rendered from `sarathictl bench paper`'s results.

Only the text between the begin and end markers is ours; the rest of the file is left alone.
"""

from __future__ import annotations

import os
import platform
from collections import defaultdict
from pathlib import Path
from typing import Any

BEGIN = "<!-- bench-paper:begin -->"
END = "<!-- bench-paper:end -->"

# Published figures of arXiv 2403.02310 (text; the per-configuration bars are only in Figs. 9-10).
PAPER_UP_TO = {
    "mistral-7b": ("2.6x", "abstract: up to 2.6x (both datasets, both SLOs)"),
    "yi-34b": ("2.8x", "section 1: up to 2.8x"),
    "llama2-70b": ("> 1x", "section 5.1: consistently ahead; no figure in the text"),
    "falcon-180b": ("6.9x", "abstract: up to 6.9x over Orca and vLLM"),
}
PAPER_CELLS = {
    ("mistral-7b", "sharegpt-paper", "strict"): "3.2x over Orca (5.1)",
    ("yi-34b", "sharegpt-paper", "relaxed"): "2.7x over vLLM (5.1)",
}
# Table 4 of the paper: (P50 TTFT, P99 TBT) in seconds.
PAPER_TABLE4 = {
    ("hybrid-batching-only", "sharegpt-paper"): (0.56, 1.08),
    ("chunked-prefills-only", "sharegpt-paper"): (1.04, 0.34),
    ("Sarathi-Serve (combined)", "sharegpt-paper"): (0.85, 0.29),
    ("hybrid-batching-only", "arxiv"): (4.18, 1.76),
    ("chunked-prefills-only", "arxiv"): (4.86, 0.38),
    ("Sarathi-Serve (combined)", "arxiv"): (3.03, 0.35),
}
WORKLOAD_NOTES = {
    "sharegpt-paper": "log-normal matched to Table 2's openchat_sharegpt4 (prompt median 1730, "
    "P90 5696; output 415 / 834), requests over 8192 tokens dropped: the paper's trace is not "
    "public and no shared trace of it exists",
    "arxiv": "the shared arxiv_summarization trace (real lengths of the same dataset, prompt "
    "median 2730, filtered to 4096 total tokens), preferred to a synthetic because its "
    "shape is real; its prompts are about 2.6x shorter than the paper's (median 7059, up to 16k)",
    "arxiv-paper": "log-normal matched to Table 2's arxiv_summarization (prompt median 7059, "
    "P90 12985), requests over 16384 tokens dropped",
}


def hardware_summary() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores visible, Python {platform.python_version()}"


def _ratio(a: float, b: float) -> str:
    if b <= 0:
        return "inf" if a > 0 else "-"
    return f"{a / b:.2f}x"


def _capacity_table(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, float]]:
    cells: dict[tuple[str, str, str, str], float] = {}
    models: dict[str, str] = {}
    for r in rows:
        cells[(r["label"], r["workload"], r["slo"], r["policy"])] = float(r["capacity_qps"])
    for r in rows:
        models[r["label"]] = r.get("model", "")
    lines = [
        "| deployment | workload | SLO (P99 TBT) | sarathi qps | vllm qps | orca qps | "
        "ours: sarathi / vllm | ours: sarathi / orca | paper |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    best: dict[str, float] = defaultdict(float)
    seen: list[tuple[str, str, str, float, str]] = []
    for r in rows:
        key = (r["label"], r["workload"], r["slo"], r["tbt_slo_s"], r["model"])
        if key not in seen:
            seen.append(key)
    for label, workload, slo, slo_s, model in seen:
        s = cells.get((label, workload, slo, "sarathi"), 0.0)
        v = cells.get((label, workload, slo, "vllm"), 0.0)
        o = cells.get((label, workload, slo, "orca"), 0.0)
        for base in (v, o):
            if base > 0:
                best[model] = max(best[model], s / base)
        paper = PAPER_CELLS.get((model, workload, slo), "")
        lines.append(
            f"| {label} | {workload} | {slo} {slo_s:g} s | {s:.3f} | {v:.3f} | {o:.3f} | "
            f"{_ratio(s, v)} | {_ratio(s, o)} | {paper} |"
        )
    return lines, dict(best)


def render(report: dict[str, Any]) -> str:
    """The whole section, BEGIN to END, from `sarathictl bench paper`'s report (its JSON)."""
    main = [r for r in report["capacity"] if r["group"] == "main"]
    tp8 = [r for r in report["capacity"] if r["group"] == "tp8"]
    table, best = _capacity_table(main)
    ablation = report.get("ablation") or []
    out = [
        BEGIN,
        *_intro(report),
        "",
        *table,
        "",
        _sarathi_wins_line(main),
        "",
        *_paper_up_to_table(best),
        *_tp8_section(tp8),
        *_ablation_section(ablation),
        *_budget_sweep_section(report.get("budget_sweep") or []),
        "",
        *_differences(best, main, ablation, report.get("median_prefills") or []),
        END,
    ]
    return "\n".join(out) + "\n"


def _intro(report: dict[str, Any]) -> list[str]:
    """Title, how the figures were made (command, date, machine, requests per run), the
    definition of capacity and a line per workload on where its lengths come from."""
    out = [
        "## The paper's capacity study, simulated (`make bench-paper`)",
        "",
        f"`make bench-paper` runs `{report.get('command', 'sarathictl bench paper')}`; this "
        f"section is its output of {report.get('date', 'an unrecorded date')}, on "
        f"{report.get('hardware', hardware_summary())}: {report['wall_s']:.0f} s wall time, "
        f"{report['num_requests']} requests per run (seed {report['seed']}). The GPUs are "
        "simulated (controller/simulator/cost_model.py documents the model and its factors).",
        "",
        "Capacity: the highest Poisson rate with P99 TBT within the SLO and median scheduling "
        "delay within 2 s, by bisection to 2.5%. Token budgets 512 (strict) and 2048 (relaxed; "
        "LLaMA2-70B 1536); vllm and orca batch whole prompts up to the longest request's length.",
        "",
        "Workloads:",
    ]
    for workload in report["workloads"]:
        out.append(f"- `{workload}`: {WORKLOAD_NOTES.get(workload, 'as named')}.")
    return out


def _sarathi_wins_line(main: list[dict[str, Any]]) -> str:
    """The count of cells (deployment, workload, SLO) where sarathi's capacity beats every other
    policy's, out of all cells."""
    wins = sum(
        1
        for r in main
        if r["policy"] == "sarathi"
        and all(
            r["capacity_qps"] > o["capacity_qps"]
            for o in main
            if o["policy"] != "sarathi"
            and (o["label"], o["workload"], o["slo"]) == (r["label"], r["workload"], r["slo"])
        )
    )
    num_cells = sum(1 for r in main if r["policy"] == "sarathi")
    return f"Sarathi ahead of both baselines in {wins} of {num_cells} cells."


def _paper_up_to_table(best: dict[str, float]) -> list[str]:
    """Per model, our best sarathi ratio beside the paper's "up to" figure."""
    out = [
        "| model | ours: best sarathi ratio over vllm or orca | paper |",
        "| --- | ---: | --- |",
    ]
    for model, (figure, source) in PAPER_UP_TO.items():
        ours = best.get(model)
        ours_text = f"{ours:.2f}x" if ours is not None else "-"
        out.append(f"| {model} | {ours_text} | {figure} ({source}) |")
    return out


def _tp8_section(tp8: list[dict[str, Any]]) -> list[str]:
    """Falcon-180B's TP8 against TP4-PP2 layouts, capacities in qps (none if not run)."""
    if not tp8:
        return []
    out = [
        "",
        "Falcon-180B on 8 A100s, arxiv: TP8 across two nodes (all-reduces on 100 GbE) "
        "versus TP4-PP2 (one activation transfer per micro-batch). The paper gives no figure "
        "for this comparison, so there is none beside ours:",
        "",
        "| layout | SLO | sarathi qps | vllm qps |",
        "| --- | --- | ---: | ---: |",
    ]
    layouts: dict[tuple[str, str, float], dict[str, float]] = defaultdict(dict)
    for r in tp8:
        layouts[(r["label"], r["slo"], r["tbt_slo_s"])][r["policy"]] = r["capacity_qps"]
    for (label, slo, slo_s), caps in layouts.items():
        out.append(
            f"| {label} | {slo} {slo_s:g} s | {caps.get('sarathi', 0):.3f} | "
            f"{caps.get('vllm', 0):.3f} |"
        )
    return out


def _ablation_section(ablation: list[dict[str, Any]]) -> list[str]:
    """Table 4's ablation, our P50 TTFT and P99 TBT in seconds beside the paper's (our
    arxiv-paper rows against its arxiv figures); none if not run."""
    if not ablation:
        return []
    out = [
        "",
        "Table 4 ablation, Yi-34B TP2 A100, budget 1024, 128 requests (rate: half the "
        "deployment's first-guess capacity; the paper does not state its rate):",
        "",
        "| scheduler | workload | qps | ours P50 TTFT s | ours P99 TBT s | paper P50 TTFT s "
        "| paper P99 TBT s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in ablation:
        paper = PAPER_TABLE4.get((r["scheduler"], r["workload"]))
        if paper is None and r["workload"] == "arxiv-paper":
            paper = PAPER_TABLE4.get((r["scheduler"], "arxiv"))
        p_ttft, p_tbt = (f"{paper[0]:.2f}", f"{paper[1]:.2f}") if paper else ("-", "-")
        out.append(
            f"| {r['scheduler']} | {r['workload']} | {r['qps']:.3f} | {r['ttft_p50_s']:.2f} "
            f"| {r['tbt_p99_s']:.2f} | {p_ttft} | {p_tbt} |"
        )
    return out


def _budget_sweep_section(sweep: list[dict[str, Any]]) -> list[str]:
    """Sarathi at one rate over several token budgets: P99 TBT and median scheduling delay in
    seconds, bubble fraction, requests/s (none if not run)."""
    if not sweep:
        return []
    first = sweep[0]
    out = [
        "",
        f"Token budget and pipeline bubbles: {first['label']}, {first['workload']}, sarathi "
        f"at its strict-SLO capacity ({first['qps']:.3f} qps):",
        "",
        "| budget tokens | P99 TBT s | median scheduling delay s | bubble fraction | req/s |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sweep:
        out.append(
            f"| {r['budget_tokens']} | {r['tbt_p99_s']:.3f} | "
            f"{r['scheduling_delay_p50_s']:.2f} | {r['bubble_fraction']:.1%} | "
            f"{r['throughput_rps']:.3f} |"
        )
    return out


def _differences(
    best: dict[str, float],
    main: list[dict[str, Any]],
    ablation: list[dict[str, Any]],
    prefills: list[dict[str, Any]],
) -> list[str]:
    """Where our figures differ from the paper's and why: always the known causes, then a
    paragraph for each surprise the results show (relaxed below strict, an inverted ablation)."""
    return [
        _known_causes(best, prefills),
        *_relaxed_below_strict(main),
        *_chunked_only_above_hybrid(ablation),
    ]


def _known_causes(best: dict[str, float], prefills: list[dict[str, Any]]) -> str:
    """Our best ratios against the paper's, and the causes of the differences we know of."""
    stalls = (
        ", ".join(
            f"{r['prefill_s']:.2f} s on {r['label']} with {r['workload']} "
            f"(strict SLO {r['strict_slo_s']:g} s)"
            for r in prefills
        )
        or "(not recorded)"
    )
    return (
        "Where ours differ, and why. Best ratios, ours against the paper's: "
        + "; ".join(_ratio_gaps(best))
        + ". The paper's figures are measurements of a vLLM-0.2-based engine; ours come from a "
        "cost model with fixed efficiency factors and no run-to-run noise, so absolute "
        "capacities differ and ratios move with how close each baseline sits to its SLO. "
        "Causes we know of: (1) under the strict SLO, one whole prompt of median length "
        f"stalls every running decode for {stalls}; where that exceeds the SLO, vllm and orca "
        "pass only while such stalled gaps stay under 1% of all gaps, while our noiseless model "
        "lets sarathi run closer to its limit than a real engine can; (2) the shared arxiv "
        "trace is cut at 4096 tokens, so prefill stalls under vllm/orca are shorter than with "
        "the paper's prompts of up to 16k tokens, which should make our arxiv ratios smaller "
        "than the paper's arxiv ratios; (3) the sharegpt workload is a log-normal fitted to "
        "two quantiles, not the trace; (4) our orca follows the paper's "
        "account of it (KV reserved for the full length of every request, so fewer fit, and the "
        "prompts of all admitted requests batched together; `--orca-paged` lifts both); (5) no "
        "CPU-side variance, NCCL jitter or memory fragmentation, which widen P99 TBT for every "
        "policy in a real system."
    )


def _ratio_gaps(best: dict[str, float]) -> list[str]:
    """Per model with a numeric "up to" figure in the paper: our best ratio against it, and
    how far off in percent."""
    parts = []
    for model, (figure, _) in PAPER_UP_TO.items():
        ours = best.get(model)
        if ours is None or not figure.endswith("x") or figure.startswith(">"):
            continue
        paper = float(figure[:-1])
        parts.append(f"{model} {ours:.2f}x against {paper:g}x ({(ours / paper - 1):+.0%})")
    return parts


def _relaxed_below_strict(main: list[dict[str, Any]]) -> list[str]:
    """A paragraph on the cells where sarathi serves less under the relaxed SLO than under the
    strict one (the larger relaxed budgets widen the pipeline's bubbles); none if there are
    none."""
    strict = {
        (r["label"], r["workload"]): r["capacity_qps"]
        for r in main
        if r["policy"] == "sarathi" and r["slo"] == "strict"
    }
    lower = [
        f"{r['label']} on {r['workload']} ({r['capacity_qps']:.3f} against "
        f"{strict[(r['label'], r['workload'])]:.3f} qps)"
        for r in main
        if r["policy"] == "sarathi"
        and r["slo"] == "relaxed"
        and r["capacity_qps"] < strict.get((r["label"], r["workload"]), 0.0)
    ]
    if not lower:
        return []
    return [
        "",
        "Sarathi's capacity is lower under the relaxed SLO than under the strict one for "
        + "; ".join(lower)
        + ". The relaxed runs use the paper's larger budgets, and in a pipeline a large "
        "prefill chunk followed by a decode-only micro-batch leaves the stages waiting on "
        "each other (the budget table above shows the bubble fraction growing with the "
        "budget): the effect that made the paper give LLaMA2-70B a budget of 1536.",
    ]


def _chunked_only_above_hybrid(ablation: list[dict[str, Any]]) -> list[str]:
    """A paragraph on the workloads where our chunked-prefills-only ablation has a higher P99
    TBT than hybrid-batching-only, the reverse of the paper's Table 4; none if there are none."""
    tbt = {(r["scheduler"], r["workload"]): r["tbt_p99_s"] for r in ablation}
    inverted = [
        w
        for (name, w), value in tbt.items()
        if name == "chunked-prefills-only" and value > tbt.get(("hybrid-batching-only", w), 1e9)
    ]
    if not inverted:
        return []
    return [
        "",
        "In the ablation our chunked-prefills-only has a higher P99 TBT than "
        f"hybrid-batching-only on {', '.join(inverted)}, unlike the paper: our variant keeps "
        "decodes out of every micro-batch that carries a chunk, so a decode waits for all "
        "chunks of a prompt, while hybrid batching stalls it for one whole-prompt step.",
    ]


def write_section(path: Path, report: dict[str, Any]) -> None:
    section = render(report)
    if not path.exists():
        path.write_text("# Benchmarks\n\n" + section)
        return
    text = path.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        path.write_text(head + section.rstrip("\n") + tail)
    else:
        path.write_text(text.rstrip("\n") + "\n\n" + section)
