"""The layout `sarathictl tune-layout` measured, kept per machine, and what `up --local` makes of
it: the measured winner (its depth, and for --dtype auto its dtype) where the CPU, cores, dtype
asked for and model are the ones measured, the rule's layout anywhere else, and a start whatever
state the file is in."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
from sarathictl import layout_choice
from sarathictl.commands import up
from sarathictl.commands.tune_layout import turns
from sarathictl.layout_file import (
    LayoutFigures,
    LayoutFileError,
    MeasuredLayout,
    choose,
    machine_key,
    read_measured,
    write_measured,
)

CPUINFO = (
    "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse2 avx2 fma avx512f\n\n"
    "processor\t: 1\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse2 avx2 fma avx512f\n"
)


@pytest.fixture(autouse=True)
def _cpu_measured_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """up's rules read this machine's CPU (its dtype, and where the PP=1 rule is extrapolated):
    these tests run on the Zen 5 EPYC's kind, whatever machine runs them (test_up_defaults.py
    covers the others)."""
    zen5 = layout_choice.CpuId("AuthenticAMD", frozenset({"avx2", "avx512f", "avx512_bf16"}))
    real = layout_choice.read_cpu_id

    def read_cpu_id(cpuinfo: str = "/proc/cpuinfo") -> layout_choice.CpuId:
        return zen5 if cpuinfo == "/proc/cpuinfo" else real(cpuinfo)  # a test's own file: read

    monkeypatch.setattr(layout_choice, "read_cpu_id", read_cpu_id)


def figures(
    pp: int, requests_per_s: float, tpot_ms: float, dtype: str = "float32"
) -> LayoutFigures:
    return LayoutFigures(pp, dtype, 2 // pp, 64 * pp, requests_per_s, 900.0, tpot_ms)


WORKLOAD = "4 rounds of a lone request and a burst of 8 requests of 256 + 64 tokens"


def measured(pp: int) -> MeasuredLayout:
    both = (figures(1, 0.6, 24.0), figures(2, 0.5, 36.0))
    return MeasuredLayout(pp, "float32", "2026-11-27", WORKLOAD, both)


def measured_two_dtypes() -> MeasuredLayout:
    """As on a CPU with native bf16: PP=2 in bf16 serves most, and at PP=1 float32 beats bf16."""
    four = (
        figures(1, 0.50, 20.0, "bfloat16"),
        figures(2, 0.70, 40.0, "bfloat16"),
        figures(1, 0.60, 18.0, "float32"),
        figures(2, 0.55, 30.0, "float32"),
    )
    return MeasuredLayout(2, "bfloat16", "2026-11-27", WORKLOAD, four)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 64}')
    return folder


def test_the_key_names_the_cpu_its_kernel_flags_the_cores_the_dtype_and_the_model(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1})
    key = machine_key(str(model_dir), "float32", str(cpuinfo))
    assert (key.cpu, key.flags, key.cores, key.dtype) == (
        "Example CPU 9000",
        ("avx2", "fma", "avx512f"),
        2,
        "float32",
    )
    assert machine_key(str(model_dir), "bfloat16", str(cpuinfo)) != key
    (model_dir / "config.json").write_text('{"hidden_size": 128}')  # another model's shape
    assert machine_key(str(model_dir), "float32", str(cpuinfo)).model != key.model
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert machine_key(str(model_dir), "float32", str(cpuinfo)).cores == 4
    with pytest.raises(ValueError, match=r"config\.json"):
        machine_key(str(tmp_path / "nowhere"), "float32", str(cpuinfo))


def test_the_fastest_layout_wins_and_a_near_tie_goes_to_the_faster_decode() -> None:
    assert choose((figures(1, 0.60, 30.0), figures(2, 0.45, 20.0))).pp == 1
    assert choose((figures(1, 0.40, 20.0), figures(2, 0.45, 30.0))).pp == 2
    # within 5% of the best throughput: the lone request's TPOT decides
    assert choose((figures(1, 0.44, 20.0), figures(2, 0.45, 30.0))).pp == 1
    with pytest.raises(ValueError, match="no layout"):
        choose(())
    # each depth's own winner, for a --pp given to up
    two = measured_two_dtypes()
    assert two.winner().name == "PP=2 bfloat16"
    assert two.best_at(1) == figures(1, 0.60, 18.0, "float32")
    assert two.best_at(2) == two.winner()
    assert two.best_at(4) is None
    # At the winner's own depth the winner runs, though the tie band, drawn from that depth's
    # best alone, would take in a layout with a faster lone decode that the full band left out.
    three = (
        figures(2, 1.00, 50.0, "bfloat16"),
        figures(1, 0.96, 30.0, "float32"),
        figures(1, 0.93, 10.0, "bfloat16"),
    )
    won = choose(three)
    assert won.name == "PP=1 float32"
    banded = MeasuredLayout(won.pp, won.dtype, "2026-11-27", WORKLOAD, three)
    assert banded.best_at(1) == won
    # one dtype's layouts alone, as `up --dtype NAME` takes them from an auto measurement
    bf16 = two.only("bfloat16")
    assert bf16 is not None and {f.dtype for f in bf16.figures} == {"bfloat16"}
    assert (bf16.pp, bf16.dtype) == (2, "bfloat16")
    f32 = two.only("float32")
    assert f32 is not None and (f32.pp, f32.dtype) == (1, "float32")
    assert two.only("float16") is None


def test_an_entry_is_read_back_for_its_machine_only_and_others_stay(
    tmp_path: Path, model_dir: Path
) -> None:
    path = tmp_path / "cache" / "layouts.json"
    here = machine_key(str(model_dir), "float32")
    there = machine_key(str(model_dir), "bfloat16")
    assert read_measured(path, here) is None  # no file yet
    write_measured(path, here, measured(1))
    assert read_measured(path, here) == measured(1)
    assert read_measured(path, there) is None
    write_measured(path, there, measured(2))
    assert read_measured(path, here) == measured(1)
    assert read_measured(path, there) == measured(2)
    assert [p.name for p in path.parent.iterdir()] == ["layouts.json"]  # no temporary left


def test_an_unreadable_file_is_reported_and_replaced_by_the_next_measurement(
    tmp_path: Path, model_dir: Path
) -> None:
    path = tmp_path / "layouts.json"
    key = machine_key(str(model_dir), "float32")
    write_measured(path, key, measured(1))
    entry = json.loads(path.read_text())
    entry["machines"][key.as_text()]["figures"][1]["burst_requests_per_s"] = 0
    zeroed = json.dumps(entry)
    entry["machines"][key.as_text()]["figures"][1]["burst_requests_per_s"] = "0.5"
    stringly = json.dumps(entry)
    entry["machines"][key.as_text()]["figures"][1]["burst_requests_per_s"] = 0.5
    entry["machines"][key.as_text()]["figures"][1]["dtype"] = "float8"
    unknown_dtype = json.dumps(entry)
    entry["machines"][key.as_text()]["figures"][1]["dtype"] = ["float32"]  # unhashable
    listed_dtype = json.dumps(entry)
    entry["machines"][key.as_text()]["figures"][1]["dtype"] = "float32"
    entry["machines"][key.as_text()]["figures"][1]["pp"] = 1.5
    fractional_pp = json.dumps(entry)
    entry["machines"][key.as_text()]["figures"][1]["pp"] = 2
    entry["machines"][key.as_text()]["pp"] = 4
    lost_winner = json.dumps(entry)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(LayoutFileError, match="decode"):
        read_measured(path, key)
    for text, why in (
        ("{", "not JSON"),
        ('{"version": 1, "machines": {}}', "not a version 2 layout file .`sarathictl tune"),
        ('{"version": 2}', "no `machines`"),
        (json.dumps({"version": 2, "machines": {key.as_text(): {"pp": 1}}}), "malformed"),
        (zeroed, "malformed"),
        (stringly, "malformed"),
        (unknown_dtype, "unknown dtype 'float8'"),
        (listed_dtype, r"unknown dtype \['float32'\]"),
        (fractional_pp, "whole numbers"),
        (lost_winner, "the winner is not among its layouts"),
    ):
        path.write_text(text)
        with pytest.raises(LayoutFileError, match=why):
            read_measured(path, key)
    write_measured(path, key, measured(2))
    assert read_measured(path, key) == measured(2)


def test_the_reason_gives_the_ratios_against_every_other_layout() -> None:
    why = measured(1).why()
    assert "on 2026-11-27" in why
    assert "1.20x PP=2 float32's throughput, 0.67x its TPOT" in why
    assert "a burst of 8 requests" in why
    two = measured_two_dtypes().why()
    assert two.count("x its TPOT") == 3
    assert "1.40x PP=1 bfloat16's throughput, 2.00x its TPOT" in two


def up_args(model_dir: Path, layout_file: Path | str, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_cluster_flags(parser)
    up.add_layout_file_flag(parser)
    up.add_budget_flags(parser)
    parser.set_defaults(pp=None, budget=None, idle_budget=None)  # as `up` registers it
    return parser.parse_args(["--model", str(model_dir), "--layout-file", str(layout_file), *flags])


@pytest.mark.parametrize("rule_pp", [1, 2], ids=["rule-pp1", "rule-pp2"])
def test_up_runs_the_measured_layout_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path, rule_pp: int
) -> None:
    monkeypatch.setattr(layout_choice, "default_dtype", lambda _device: "float32")
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(
        "stage_worker.native.fused_kernels", lambda: object() if rule_pp == 1 else None
    )
    path = tmp_path / "layouts.json"
    args = up_args(model_dir, path)
    assert up.cluster_config(args, port=0).pp == rule_pp  # nothing measured: the rule
    won = 3 - rule_pp  # the measurement says the other depth
    write_measured(path, machine_key(str(model_dir), "auto"), measured(won))  # up's --dtype
    config = up.cluster_config(args, port=0)
    assert (config.pp, config.budget_tokens) == (won, layout_choice.LAYOUTS[won].budget_tokens)
    assert config.idle_budget_tokens == layout_choice.LAYOUTS[won].idle_budget_tokens
    assert config.threads_per_worker == 2 // won
    said = up.describe_layout(config, args)
    assert f"PP={won} float32, " in said
    assert "measured on this machine by `sarathictl tune-layout`" in said
    # --pp wins over the measurement, and takes the budgets measured for its own depth
    given = up.cluster_config(up_args(model_dir, path, "--pp", str(rule_pp)), port=0)
    assert given.pp == rule_pp
    assert given.budget_tokens == layout_choice.LAYOUTS[rule_pp].budget_tokens
    assert given.idle_budget_tokens == layout_choice.LAYOUTS[rule_pp].idle_budget_tokens
    # tune-layout measures TP=1: another TP goes by the rule; so does an empty --layout-file
    assert up.cluster_config(up_args(model_dir, path, "--tp", "2"), port=0).pp == rule_pp
    assert up.cluster_config(up_args(model_dir, ""), port=0).pp == rule_pp
    # measured for --dtype auto (float32 alone, as on this CPU): a dtype named takes its own
    # layouts from it, and goes by the rule where none was measured
    named = up.cluster_config(up_args(model_dir, path, "--dtype", "float32"), port=0)
    assert (named.pp, named.dtype) == (won, "float32")
    bf16 = up.cluster_config(up_args(model_dir, path, "--dtype", "bfloat16"), port=0)
    assert bf16.pp == layout_choice.default_layout("cpu").pp
    # a measurement of its own for a dtype named comes first
    write_measured(path, machine_key(str(model_dir), "float32"), measured(rule_pp))
    named = up.cluster_config(up_args(model_dir, path, "--dtype", "float32"), port=0)
    assert named.pp == rule_pp


def test_up_runs_the_dtype_measured_fastest_at_its_depth(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path
) -> None:
    """On a CPU with native bf16, tune-layout measures bf16 and float32 at both depths; `up
    --dtype auto` runs the winner, and at a --pp given, that depth's fastest dtype."""
    monkeypatch.setattr(layout_choice, "default_dtype", lambda _device: "bfloat16")
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr("stage_worker.native.fused_kernels", lambda: object())
    path = tmp_path / "layouts.json"
    args = up_args(model_dir, path)
    config = up.cluster_config(args, port=0)  # nothing measured yet: the rule, and a hint
    assert config.dtype == "bfloat16"
    assert "not yet measured against it here: `sarathictl tune-layout`" in up.describe_layout(
        config, args
    )
    write_measured(path, machine_key(str(model_dir), "auto"), measured_two_dtypes())
    config = up.cluster_config(args, port=0)
    assert (config.pp, config.dtype) == (2, "bfloat16")
    said = up.describe_layout(config, args)
    assert "bfloat16: measured faster than float32 at PP=2 here by `sarathictl tune-layout`" in said
    assert "PP=2 bfloat16, a share of the cores a stage: measured on this machine" in said
    at_pp1 = up_args(model_dir, path, "--pp", "1")
    config = up.cluster_config(at_pp1, port=0)
    assert (config.pp, config.dtype) == (1, "float32")
    assert "float32: measured faster than bfloat16 at PP=1" in up.describe_layout(config, at_pp1)
    # a dtype named is run as named, at its own measured winner's depth
    named = up.cluster_config(up_args(model_dir, path, "--dtype", "float32"), port=0)
    assert (named.pp, named.dtype) == (1, "float32")
    # demo and the benchmarks (no --layout-file flag) go by the rule, whatever is measured
    parser = argparse.ArgumentParser()
    up.add_cluster_flags(parser)
    demo_like = parser.parse_args(["--model", str(model_dir), "--pp", "1"])
    assert up.cluster_config(demo_like, port=0).dtype == "bfloat16"


@pytest.mark.parametrize(
    ("flags", "fused", "dtypes"),
    [
        ("avx2 fma avx512_bf16", True, ("bfloat16", "float32")),
        ("avx2 fma amx_bf16 amx_tile", True, ("bfloat16", "float32")),
        ("avx512_bf16", False, ("bfloat16",)),  # no float32 kernels: bf16 only
        ("avx2 fma", True, ("float32",)),
    ],
)
def test_tune_layout_measures_float32_beside_native_bf16_where_the_float32_kernels_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: str, fused: bool, dtypes: tuple[str]
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"model name\t: Example CPU\nflags\t\t: fpu {flags}\n")
    rule = layout_choice.default_dtype
    monkeypatch.setattr(layout_choice, "default_dtype", lambda device: rule(device, str(cpuinfo)))
    monkeypatch.setattr("stage_worker.native.fused_kernels", lambda: object() if fused else None)
    assert layout_choice.auto_dtypes() == dtypes
    assert layout_choice.auto_dtypes("cuda") == ("bfloat16",)


def test_up_starts_on_the_rule_when_the_file_is_unreadable_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path
) -> None:
    monkeypatch.setattr(layout_choice, "default_dtype", lambda _device: "float32")
    path = tmp_path / "layouts.json"
    path.write_text("not json")
    args = up_args(model_dir, path)
    config = up.cluster_config(args, port=0)
    assert config.pp == layout_choice.default_layout("cpu").pp
    assert f"the measured layouts passed over: {path}: not JSON" in up.describe_layout(config, args)


def test_the_layouts_take_turns_forwards_then_backwards_so_drift_falls_on_all_alike() -> None:
    assert turns(2, 3) == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]
    assert [i for _, i in turns(4, 2)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert turns(2, 1) == [(0, 0), (0, 1)]


def test_each_layout_is_measured_once_a_round_with_that_round_s_prompts(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    """measure_all without clusters: the turns, the seeds and each layout's medians."""
    from sarathictl.bench.layout_probe import ProbeResult, ProbeWorkload
    from sarathictl.commands import tune_layout

    calls: list[tuple[str, int]] = []
    rates = iter([0.5, 0.7, 0.8, 0.6, 0.9, 0.7])  # in turn order: A B B A A B

    def fake_measure(candidate, config, workload, seed, label):  # type: ignore[no-untyped-def]
        calls.append((candidate.name, seed))
        return ProbeResult(next(rates), 1.0, 0.02 * candidate.layout.pp)

    monkeypatch.setattr(tune_layout, "measure_once", fake_measure)
    monkeypatch.setattr(tune_layout, "check_before_measuring", lambda configs, workload: None)
    candidates = [
        tune_layout.Candidate(layout, "float32") for layout in layout_choice.LAYOUTS.values()
    ]
    args = argparse.Namespace(kv_cache_mb=16, rounds=3, seed=7)
    workload = ProbeWorkload(2, 24, 4)
    figures = tune_layout.measure_all(candidates, str(model_dir), workload, args).figures
    assert calls == [
        ("PP=1 float32", 7), ("PP=2 float32", 7),
        ("PP=2 float32", 8), ("PP=1 float32", 8),
        ("PP=1 float32", 9), ("PP=2 float32", 9),
    ]  # fmt: skip
    assert [f.burst_requests_per_s for f in figures] == [
        0.6,
        0.7,
    ]  # medians of (.5 .6 .9), (.7 .8 .7)
    assert [f.lone_tpot_ms for f in figures] == [20.0, 40.0]
    # what the budget's fit needs: the lone prompt's length and the budget it went in
    assert [(f.prompt_tokens, f.idle_budget_tokens) for f in figures] == [(24, 512), (24, 0)]


def test_a_layout_that_fails_is_left_out_and_the_others_measured(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    """On a CPU no one has measured, one layout whose cluster dies (a kernel, memory) should
    not cost the verdict: it is left out after its first failure, saying why."""
    from sarathictl.bench.layout_probe import ProbeResult, ProbeWorkload
    from sarathictl.commands import tune_layout

    calls: list[str] = []

    def fake_measure(candidate, config, workload, seed, label):  # type: ignore[no-untyped-def]
        calls.append(candidate.name)
        if candidate.layout.pp == 2:
            raise RuntimeError(
                "stage1-rank0 exited with code -4; its log ends:\nIllegal instruction"
            )
        return ProbeResult(0.5, 1.0, 0.02)

    monkeypatch.setattr(tune_layout, "measure_once", fake_measure)
    monkeypatch.setattr(tune_layout, "check_before_measuring", lambda configs, workload: None)
    candidates = [
        tune_layout.Candidate(layout, "float32") for layout in layout_choice.LAYOUTS.values()
    ]
    args = argparse.Namespace(kv_cache_mb=16, rounds=4, seed=0)
    got = tune_layout.measure_all(candidates, str(model_dir), ProbeWorkload(2, 24, 4), args)
    assert [f.name for f in got.figures] == ["PP=1 float32"]
    assert got.failed == {
        "PP=2 float32": "stage1-rank0 exited with code -4; its log ends: ... Illegal instruction"
    }
    assert calls.count("PP=2 float32") == 1 and calls.count("PP=1 float32") == 4
    # every layout failing is an error, naming each

    def never_serves(*_: object) -> ProbeResult:
        raise TimeoutError("not serving within 300 s")

    monkeypatch.setattr(tune_layout, "measure_once", never_serves)
    with pytest.raises(RuntimeError, match="every layout failed: PP=1 float32: not serving"):
        tune_layout.measure_all(candidates, str(model_dir), ProbeWorkload(2, 24, 4), args)


# Session 26's medians on the Zen 5 EPYC at PP=1 (a 256-token lone prompt in one step, then its
# decodes): budget_fit puts bf16's budget at 160 (64 at PP=2) and float32's at 128
# (test_budget_fit.py).
ZEN5_BF16 = (121.3, 14.6)
ZEN5_FLOAT32 = (268.6, 11.6)


def pp1(ttft_tpot: tuple[float, float], dtype: str, prompt_tokens: int = 256) -> LayoutFigures:
    ttft_ms, tpot_ms = ttft_tpot
    return LayoutFigures(1, dtype, 2, 64, 3.0, ttft_ms, tpot_ms, prompt_tokens, 512)


def pp2(dtype: str, requests_per_s: float) -> LayoutFigures:
    return LayoutFigures(2, dtype, 1, 128, requests_per_s, 169.0, 18.4, 256, 0)


def test_up_runs_pp1_at_the_budget_fitted_to_the_measured_steps_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path
) -> None:
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    path = tmp_path / "layouts.json"
    both = (pp1(ZEN5_BF16, "bfloat16"), pp2("bfloat16", 2.7), pp1(ZEN5_FLOAT32, "float32"))
    workload = "4 rounds of a lone request and a burst of 8 requests of 256 + 64 tokens"
    won_pp1 = MeasuredLayout(1, "bfloat16", "2026-11-28", workload, both)
    write_measured(path, machine_key(str(model_dir), "auto"), won_pp1)
    args = up_args(model_dir, path)
    config = up.cluster_config(args, port=0)
    assert (config.pp, config.dtype, config.budget_tokens) == (1, "bfloat16", 160)
    assert config.idle_budget_tokens == layout_choice.IDLE_BUDGET_TOKENS
    said = up.describe_layout(config, args)
    assert "budget 160: fitted to the steps `sarathictl tune-layout` measured here" in said
    assert "the strict TBT SLO (138 ms, 5x a decode step of a batch of 32) over 1.5" in said
    # float32 named: its own PP=1 figures set its budget
    named = up.cluster_config(up_args(model_dir, path, "--dtype", "float32"), port=0)
    assert (named.pp, named.budget_tokens) == (1, 128)
    # --budget still wins, and up then says nothing about the fit
    chosen_args = up_args(model_dir, path, "--budget", "96")
    chosen = up.cluster_config(chosen_args, port=0)
    assert chosen.budget_tokens == 96
    assert "fitted" not in up.describe_layout(chosen, chosen_args)
    # the pipeline wins: its budget is fitted to the same SLO over both stages' steps (a
    # decode's next token waits on both), and --pp 1 given still runs the one stage's
    won_pp2 = dataclasses.replace(won_pp1, pp=2, figures=(both[0], pp2("bfloat16", 3.5)))
    write_measured(path, machine_key(str(model_dir), "auto"), won_pp2)
    pipeline = up.cluster_config(args, port=0)
    assert (pipeline.pp, pipeline.budget_tokens) == (2, 64)
    said = up.describe_layout(pipeline, args)
    assert "budget 64: fitted" in said and "step on each of the 2 stages, about 41 ms" in said
    given = up.cluster_config(up_args(model_dir, path, "--pp", "1"), port=0)
    assert (given.pp, given.budget_tokens) == (1, 160)
    # without a PP=1 measurement of its dtype the pipeline keeps its constant
    alone = dataclasses.replace(won_pp2, figures=(pp2("bfloat16", 3.5), both[2]))
    write_measured(path, machine_key(str(model_dir), "auto"), alone)
    kept = up.cluster_config(args, port=0)
    assert kept.budget_tokens == layout_choice.PP2_LAYOUT.budget_tokens


def test_a_measurement_from_before_the_fit_keeps_the_constant_budget_and_says_how_to_fit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path
) -> None:
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    path = tmp_path / "layouts.json"
    old = (pp1(ZEN5_BF16, "bfloat16", prompt_tokens=0), pp2("bfloat16", 2.7))
    measured = MeasuredLayout(1, "bfloat16", "2026-11-28", "an older run", old)
    write_measured(path, machine_key(str(model_dir), "auto"), measured)
    args = up_args(model_dir, path)
    config = up.cluster_config(args, port=0)
    assert (config.pp, config.budget_tokens) == (1, layout_choice.PP1_LAYOUT.budget_tokens)
    said = up.describe_layout(config, args)
    assert "`sarathictl tune-layout` again fits it to this machine" in said


def test_figures_that_admit_no_fit_keep_the_constant_budget_and_say_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path
) -> None:
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    path = tmp_path / "layouts.json"
    args = up_args(model_dir, path, "--dtype", "float32")
    # named as such, not as a file from before the fit
    noise = MeasuredLayout(1, "float32", "2026-11-26", "a run", (pp1((10.0, 19.1), "float32"),))
    write_measured(path, machine_key(str(model_dir), "float32"), noise)
    config = up.cluster_config(args, port=0)
    assert config.budget_tokens == layout_choice.PP1_LAYOUT.budget_tokens
    assert "admit no fit" in up.describe_layout(config, args)
