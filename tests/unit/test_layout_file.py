"""The layout `sarathictl tune-layout` measured, kept per machine, and what `up --local` makes of
it: the measured winner where the CPU, cores, dtype and model are the ones measured, the rule's
layout anywhere else, and a start whatever state the file is in."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from sarathictl.commands import up
from sarathictl.layout_file import (
    LayoutFigures,
    LayoutFileError,
    MeasuredLayout,
    choose_pp,
    machine_key,
    read_measured,
    write_measured,
)

CPUINFO = (
    "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse2 avx2 fma avx512f\n\n"
    "processor\t: 1\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse2 avx2 fma avx512f\n"
)


def figures(pp: int, requests_per_s: float, tpot_ms: float) -> LayoutFigures:
    return LayoutFigures(pp, 2 // pp, 64 * pp, requests_per_s, 900.0, tpot_ms)


def measured(pp: int) -> MeasuredLayout:
    both = (figures(1, 0.6, 24.0), figures(2, 0.5, 36.0))
    return MeasuredLayout(pp, "2026-11-27", "bursts of 8 requests of 256 + 64 tokens", both)


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
    assert choose_pp((figures(1, 0.60, 30.0), figures(2, 0.45, 20.0))) == 1
    assert choose_pp((figures(1, 0.40, 20.0), figures(2, 0.45, 30.0))) == 2
    # within 5% of the best throughput: the lone request's TPOT decides
    assert choose_pp((figures(1, 0.44, 20.0), figures(2, 0.45, 30.0))) == 1
    with pytest.raises(ValueError, match="no layout"):
        choose_pp(())


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
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(LayoutFileError, match="decode"):
        read_measured(path, key)
    for text, why in (
        ("{", "not JSON"),
        ('{"version": 99, "machines": {}}', "not a version 1"),
        ('{"version": 1}', "no `machines`"),
        (json.dumps({"version": 1, "machines": {key.as_text(): {"pp": 1}}}), "malformed"),
        (zeroed, "malformed"),
        (stringly, "malformed"),
    ):
        path.write_text(text)
        with pytest.raises(LayoutFileError, match=why):
            read_measured(path, key)
    write_measured(path, key, measured(2))
    assert read_measured(path, key) == measured(2)


def test_the_reason_gives_the_ratios_against_the_other_layout() -> None:
    why = measured(1).why()
    assert "on 2026-11-27" in why
    assert "1.20x PP=2's throughput, 0.67x its TPOT" in why
    assert "bursts of 8 requests" in why


def up_args(model_dir: Path, layout_file: Path | str, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_cluster_flags(parser)
    up.add_budget_flags(parser)
    parser.set_defaults(pp=None, budget=None, idle_budget=None)  # as `up` registers it
    return parser.parse_args(["--model", str(model_dir), "--layout-file", str(layout_file), *flags])


@pytest.mark.parametrize("rule_pp", [1, 2], ids=["rule-pp1", "rule-pp2"])
def test_up_runs_the_measured_layout_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path, rule_pp: int
) -> None:
    monkeypatch.setattr(up, "default_dtype", lambda _device: "float32")
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(
        "stage_worker.native.fused_kernels", lambda: object() if rule_pp == 1 else None
    )
    path = tmp_path / "layouts.json"
    args = up_args(model_dir, path)
    assert up.cluster_config(args, port=0).pp == rule_pp  # nothing measured: the rule
    won = 3 - rule_pp  # the measurement says the other depth
    write_measured(path, machine_key(str(model_dir), "float32"), measured(won))
    config = up.cluster_config(args, port=0)
    assert (config.pp, config.budget_tokens) == (won, up.LAYOUTS[won].budget_tokens)
    assert config.idle_budget_tokens == up.LAYOUTS[won].idle_budget_tokens
    assert config.threads_per_worker == 2 // won
    said = up.describe_layout(config, args)
    assert f"PP={won}, " in said and "measured on this machine by `sarathictl tune-layout`" in said
    # --pp wins over the measurement, and takes the budgets measured for its own depth
    given = up.cluster_config(up_args(model_dir, path, "--pp", str(rule_pp)), port=0)
    assert given.pp == rule_pp
    assert given.budget_tokens == up.LAYOUTS[rule_pp].budget_tokens
    assert given.idle_budget_tokens == up.LAYOUTS[rule_pp].idle_budget_tokens
    # tune-layout measures TP=1: another TP goes by the rule; so does an empty --layout-file
    assert up.cluster_config(up_args(model_dir, path, "--tp", "2"), port=0).pp == rule_pp
    assert up.cluster_config(up_args(model_dir, ""), port=0).pp == rule_pp
    # measured in another dtype: not this one's
    bf16 = up_args(model_dir, path, "--dtype", "bfloat16")
    assert up.cluster_config(bf16, port=0).pp == up.default_layout("cpu", "bfloat16").pp


def test_up_starts_on_the_rule_when_the_file_is_unreadable_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path
) -> None:
    monkeypatch.setattr(up, "default_dtype", lambda _device: "float32")
    path = tmp_path / "layouts.json"
    path.write_text("not json")
    args = up_args(model_dir, path)
    config = up.cluster_config(args, port=0)
    assert config.pp == up.default_layout("cpu", "float32").pp
    assert f"the measured layouts passed over: {path}: not JSON" in up.describe_layout(config, args)
