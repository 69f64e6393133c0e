"""Which layout (pipeline depth, budgets) and dtype `sarathictl up --local` runs where the user
leaves them to it: the rule taken from the side-by-side runs (default_layout, default_dtype),
or what `sarathictl tune-layout` measured fastest on this machine (layout_file.py), and why, in
words up prints. Imports torch only when a cluster is configured (the CLI's parser stays
light)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from sarathictl.budget_fit import P99_GAP_OVER_STEP, StepFit, fitted_budget
from sarathictl.layout_file import (
    LayoutFigures,
    LayoutFileError,
    MeasuredLayout,
    machine_key,
    read_measured,
)
from sarathictl.local_cluster import LOCAL_BUDGET_TOKENS
from sarathictl.slo_rule import SLO_BATCH, SLO_FACTORS


@dataclass(frozen=True)
class CpuId:
    """Who made this CPU and what it computes, as /proc/cpuinfo says."""

    vendor: str
    """vendor_id: AuthenticAMD, GenuineIntel, ...; empty where unknown."""
    flags: frozenset[str]
    """The first CPU's flags; empty where unknown."""


def read_cpu_id(cpuinfo: str = "/proc/cpuinfo") -> CpuId:
    """The first CPU's vendor and flags (both empty where cpuinfo cannot be read)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return CpuId("", frozenset())
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon:
            fields.setdefault(name.strip(), value.strip())
    return CpuId(fields.get("vendor_id", ""), frozenset(fields.get("flags", "").split()))


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""The flags of CPUs that compute bf16 natively."""


def default_dtype(device: str = "cpu", cpuinfo: str = "/proc/cpuinfo") -> str:
    """bfloat16 on a GPU, and where the CPU has native bf16 arithmetic (oneDNN's bf16 kernels
    beat its float32 ones there, and the weights take half the memory); else float32. This is
    the rule up goes by until `sarathictl tune-layout` has measured the dtypes of auto_dtypes."""
    if device != "cpu":
        return "bfloat16"
    return "bfloat16" if NATIVE_BF16_FLAGS & read_cpu_id(cpuinfo).flags else "float32"


def pp1_rule_measured(dtype: str, cpu: CpuId) -> bool:
    """Whether PP1_LAYOUT's rule was measured on a CPU of this kind in this dtype: float32 on
    the AVX2 EPYCs (AMD, AVX2 without AVX-512), bf16 on the Zen 5 EPYC (AMD, AVX512-BF16, no
    AMX). Elsewhere (another maker, AMX, float32 beside AVX-512, bf16 without AVX512-BF16, a
    CPU that says nothing) it is extrapolated."""
    if cpu.vendor != "AuthenticAMD" or "amx_bf16" in cpu.flags:
        return False
    if dtype == "float32":
        return "avx2" in cpu.flags and "avx512f" not in cpu.flags
    return dtype == "bfloat16" and "avx512_bf16" in cpu.flags


def cpu_kind(cpu: CpuId) -> str:
    """The CPU's maker and widest units, in up's words ("an Intel CPU with AMX")."""
    maker = {"AuthenticAMD": "an AMD CPU", "GenuineIntel": "an Intel CPU"}.get(cpu.vendor, "a CPU")
    if "amx_bf16" in cpu.flags:
        return f"{maker} with AMX"
    if "avx512_bf16" in cpu.flags:
        return f"{maker} with AVX512-BF16"
    if "avx512f" in cpu.flags:
        return f"{maker} with AVX-512"
    return f"{maker} with AVX2 only" if "avx2" in cpu.flags else f"{maker} without AVX2"


@dataclass(frozen=True)
class AutoLayout:
    """What `up --local` runs where the user gave no --pp, and why (a line of up's output)."""

    pp: int
    budget_tokens: int
    """The token budget at this depth, unless --budget is given (another depth given with --pp:
    LOCAL_BUDGET_TOKENS)."""
    why: str
    why_budget: str = ""
    idle_budget_tokens: int = 0
    """The budget while nothing decodes (PP = 1), unless --idle-budget is given."""
    why_idle_budget: str = ""

    @property
    def shape(self) -> str:
        return "one worker on every core" if self.pp == 1 else "a share of the cores a stage"


IDLE_BUDGET_TOKENS = 512
"""The idle budget of up's PP=1 layout (SchedulerConfig.idle_budget_tokens)."""


PP1_LAYOUT = AutoLayout(1, 64, (
    "PP=1, one worker on every core: the package's kernels spread each step over the "
    "threads, and against PP=2 (a core a stage) it served more at saturation with a lower "
    "TPOT on every CPU measured, in float32 on the AVX2 EPYCs (BENCHMARKS.md, vLLM side by "
    "side, sessions 12 and 19) and in bf16 on the Zen 5 EPYC (1.27x the burst throughput, "
    "session 30); --pp 2 runs the pipeline"
), (
    "budget 64: on the AVX2 EPYC 64-token chunks (150 ms on 2 cores) kept P99 TBT at "
    "220-260 ms at 0.25 req/s where 128 gave 370-440 (session 12); on a faster CPU `sarathictl "
    "tune-layout` fits a larger one (160 on the Zen 5 EPYC in bf16; --budget to choose)"
), IDLE_BUDGET_TOKENS, (
    f"idle budget {IDLE_BUDGET_TOKENS}: while nothing decodes, prompts go in chunks of up "
    "to that many tokens, as no one waits between tokens (--idle-budget to choose; 0: off)"
))  # fmt: skip
"""One stage on every core, with the budgets measured for it."""

PP2_LAYOUT = AutoLayout(2, LOCAL_BUDGET_TOKENS, (
    "PP=2, a share of the devices a stage: the pipeline this project is built for; PP=1 has "
    "been measured against it only on CPUs with the package's kernels (--pp 1 to compare)"
))  # fmt: skip
"""Two stages sharing the cores out."""

LAYOUTS = {layout.pp: layout for layout in (PP1_LAYOUT, PP2_LAYOUT)}
"""The layouts `up` chooses between, by depth; `sarathictl tune-layout` measures each."""


def default_layout(device: str, dtype: str = "", cpu: CpuId | None = None) -> AutoLayout:
    """The layout for this device by the side-by-side runs' rule: one stage on every core
    wherever the package's CPU kernels load (it won in both dtypes on each CPU measured), the
    pipeline elsewhere. Given the dtype (and the CPU, else this one), the rule's reason says
    where it is extrapolated (pp1_rule_measured)."""
    from stage_worker import native  # torch: only when a cluster is configured

    if device != "cpu" or native.fused_kernels() is None:
        return PP2_LAYOUT
    if not dtype:
        return PP1_LAYOUT
    cpu = read_cpu_id() if cpu is None else cpu
    if pp1_rule_measured(dtype, cpu):
        return PP1_LAYOUT
    untried = (
        f"not yet measured on {cpu_kind(cpu)} in {dtype}, so extrapolated here "
        "(`sarathictl tune-layout` measures both depths)"
    )
    return dataclasses.replace(PP1_LAYOUT, why=f"{PP1_LAYOUT.why}; {untried}")


def auto_dtypes(device: str = "cpu") -> tuple[str, ...]:
    """The dtypes `--dtype auto` may run here, for tune-layout to measure: default_dtype's pick;
    on a CPU that computes bf16 natively, float32 beside it where the AVX2 float32 kernels load.
    They read a bf16 checkpoint's weights as bf16 panels, so which of the two is faster there is
    the machine's to say (bf16 on the Zen 5 EPYC, 2.05x the burst throughput; the AMX Xeon is
    not yet measured)."""
    rule = default_dtype(device)
    if device != "cpu" or rule == "float32":
        return (rule,)
    from stage_worker import native  # torch: only when a cluster is configured

    return (rule, "float32") if native.fused_kernels() is not None else (rule,)


def rule_dtype_why(device: str, dtype: str) -> str:
    """Why default_dtype picked `dtype`, for up's line."""
    if device != "cpu":
        return "a GPU"
    if dtype == "bfloat16":
        return "this CPU computes bf16 natively"
    return "this CPU has neither AVX512-BF16 nor AMX"


@dataclass(frozen=True)
class LayoutChoice:
    """What up runs where the depth or the dtype is left to it, and why (up's lines)."""

    auto: AutoLayout
    """The layout without --pp."""
    dtype: str
    """The dtype, measured at the depth that runs, else default_dtype's (for --dtype auto)."""
    why_dtype: str
    fitted: AutoLayout | None = None
    """The depth that runs with its budget fitted to the steps tune-layout measured
    (fitted_layout: PP=1's figures, at either depth); None where nothing was measured for it."""

    def budgets_at(self, pp: int, device: str) -> AutoLayout | None:
        """The layout whose budgets go with depth `pp`: the one fitted to this machine; up's
        own pick at its depth; on a CPU, the named layout of another depth; else None (the
        local default budget)."""
        if self.fitted is not None and self.fitted.pp == pp:
            return self.fitted
        if pp == self.auto.pp:
            return self.auto
        return LAYOUTS.get(pp) if device == "cpu" else None


def fitted_layout(figures: LayoutFigures, one_stage: LayoutFigures | None = None) -> AutoLayout:
    """The named layout of `figures`' depth with its budget fitted (budget_fit.py) to the steps
    of the PP=1 figures of the same dtype: `figures` at PP=1, `one_stage` at PP=2 (a pipeline's
    lone TTFT overlaps its chunks across the stages, which the fit's line does not model)."""
    layout = LAYOUTS[figures.pp]
    fit_from = figures if layout.pp == 1 else one_stage
    fit = None if fit_from is None else fit_from.step_fit()
    if fit is not None:
        budget = fitted_budget(fit, layout.pp)
        why_fitted = _why_fitted(fit, budget, layout.pp)
        return dataclasses.replace(layout, budget_tokens=budget, why_budget=why_fitted)
    if layout.pp != 1:
        return layout  # a pipeline without one stage's fit keeps its constant budget
    why = (
        "`sarathictl tune-layout` again fits it to this machine"
        if figures.prompt_tokens == 0  # measured before the fit existed
        else "the measured figures admit no fit (a TTFT no longer than its decodes: noise)"
    )
    return dataclasses.replace(layout, why_budget=f"{layout.why_budget}; {why}")


def _why_fitted(fit: StepFit, budget: int, pp: int) -> str:
    """up's line on a fitted budget: the step's cost, the SLO and how the budget meets it. At
    the depths tune-layout runs (1, 2) some budget always fits (budget_fit.py says why)."""
    assert fit.step_ms(budget) <= fit.stage_limit_ms(pp), f"no budget fits at PP={pp}"
    steps = "step" if pp == 1 else f"step on each of the {pp} stages"
    per_stage = "" if pp == 1 else f" and {pp} (the stages' steps a token waits for)"
    return (
        f"budget {budget}: fitted to the steps `sarathictl tune-layout` measured here (about "
        f"{fit.fixed_ms:.1f} ms a step and {fit.per_token_ms:.3f} ms a token): the largest "
        f"whose {steps}, about {fit.step_ms(budget):.0f} ms, stays within "
        f"{fit.stage_limit_ms(pp):.0f} ms: the strict TBT SLO ({fit.strict_tbt_slo_ms():.0f} "
        f"ms, {SLO_FACTORS['strict']:g}x a decode step of a batch of {SLO_BATCH}) over "
        f"{P99_GAP_OVER_STEP:g} (a P99 gap's excess over the step){per_stage}, so that fewer "
        "steps pay the fixed cost while decodes keep their pace (--budget to choose)"
    )


def machine_layout(
    device: str, dtype: str, model_dir: str, layout_file: str, tp: int = 1, pp: int | None = None
) -> LayoutChoice:
    """What `sarathictl tune-layout` measured fastest for this CPU, the dtype asked for (`auto`
    or a name) and model: the winner's depth, and at depth `pp` (None: the winner's) its fastest
    dtype. Else default_layout's and default_dtype's. tune-layout measures TP=1 only. A layout
    file that cannot be read is passed over, and the reason goes into the layout's `why`, which
    up prints: up still starts."""
    rule_dtype = default_dtype(device) if dtype == "auto" else dtype
    rule = LayoutChoice(
        default_layout(device, rule_dtype), rule_dtype, rule_dtype_why(device, rule_dtype)
    )
    if device != "cpu" or tp != 1 or not layout_file:
        return rule
    try:
        measured = read_layout(Path(layout_file), model_dir, dtype)
    except LayoutFileError as err:
        auto = dataclasses.replace(
            rule.auto, why=f"{rule.auto.why}; the measured layouts passed over: {err}"
        )
        return dataclasses.replace(rule, auto=auto)
    if measured is None and dtype == "auto" and len(auto_dtypes(device)) > 1:
        unmeasured = f"{rule.why_dtype}; float32 on our kernels not yet measured against it here"
        return dataclasses.replace(rule, why_dtype=f"{unmeasured}: `sarathictl tune-layout`")
    if measured is None or measured.pp not in LAYOUTS:
        return rule
    won = measured.best_at(pp or measured.pp)
    if won is None:  # a depth tune-layout does not run
        return rule
    fitted = fitted_layout(won, measured.one_stage(won.dtype))
    chosen = fitted if fitted.pp == measured.pp else LAYOUTS[measured.pp]
    auto = dataclasses.replace(
        chosen,
        why=f"{measured.winner().name}, {chosen.shape}: {measured.why()}; --pp to choose",
    )
    others = sorted({f.dtype for f in measured.figures if f.pp == won.pp} - {won.dtype})
    why_dtype = (
        f"measured faster than {' and '.join(others)} at PP={won.pp} here by `sarathictl "
        "tune-layout`" if others else rule_dtype_why(device, won.dtype)
    )  # fmt: skip
    return LayoutChoice(auto, won.dtype, why_dtype, fitted)


def read_layout(path: Path, model_dir: str, dtype: str) -> MeasuredLayout | None:
    """The measurement for `dtype` as asked; for a dtype named with none of its own, that
    dtype's layouts in the `--dtype auto` measurement, which holds them."""
    measured = read_measured(path, machine_key(model_dir, dtype))
    if measured is not None or dtype == "auto":
        return measured
    auto = read_measured(path, machine_key(model_dir, "auto"))
    return None if auto is None else auto.only(dtype)


def threads_per_worker(num_workers: int) -> int:
    """This machine's cores (those this process may use) shared out among the workers."""
    return max(1, len(os.sched_getaffinity(0)) // num_workers)
