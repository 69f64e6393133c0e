"""`sarathictl up` and `demo` pick defaults that fit the machine: bf16 where the CPU computes it
natively, the cores shared out among the workers, and a token budget sized for CPU stages."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from sarathictl import layout_choice
from sarathictl.commands import up
from sarathictl.local_cluster import LocalClusterConfig, connect_host


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        ("fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni", "bfloat16"),
        ("fpu sse2 avx2 amx_bf16 amx_tile", "bfloat16"),
        ("fpu sse2 avx2 avx512f", "float32"),  # AVX-512 without bf16: float32 is faster
    ],
)
def test_dtype_follows_the_cpu_flags(tmp_path: Path, flags: str, dtype: str) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert layout_choice.default_dtype(cpuinfo=str(cpuinfo)) == dtype


def test_no_cpuinfo_means_float32(tmp_path: Path) -> None:
    assert layout_choice.default_dtype(cpuinfo=str(tmp_path / "missing")) == "float32"


def test_cores_are_shared_out_among_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert [layout_choice.threads_per_worker(n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]


def test_explicit_flags_win(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import argparse

    (tmp_path / "config.json").write_text("{}")
    parser = argparse.ArgumentParser()
    up.add_cluster_flags(parser)
    model = ["--model", str(tmp_path), "--pp", "1"]
    args = parser.parse_args([*model, "--dtype", "float32", "--threads", "3"])
    config = up.cluster_config(args, port=0)
    assert (config.dtype, config.threads_per_worker) == ("float32", 3)
    monkeypatch.setattr(layout_choice, "default_dtype", lambda _device: "bfloat16")
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    config = up.cluster_config(parser.parse_args(model), port=0)
    assert (config.dtype, config.threads_per_worker) == ("bfloat16", 2)


def test_budget_flags_reach_the_controller() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    up.add_budget_flags(parser)
    parser.set_defaults(device="cuda", decode_ahead=None)  # as up's parser: its own pick
    assert up.budget_args(parser.parse_args([])) == ()
    args = parser.parse_args(["--step-cost", "0.01,1e-4,1e-8", "--tbt-slo", "0.5"])
    assert up.budget_args(args) == ("--step-cost", "0.01,1e-4,1e-8", "--tbt-slo", "0.5")
    together = parser.parse_args(["--no-spread-prompts"])
    assert up.budget_args(together) == ("--no-spread-prompts",)
    # and the controller's own parser takes it into the scheduler's config: prompts are spread
    # over the pipeline unless the user says otherwise
    from controller.__main__ import build_parser, scheduler_config

    base = ["--model", "m", "--pp", "2"]
    controller = build_parser().parse_args([*base, *up.budget_args(together)])
    assert not scheduler_config(controller, 4096).spread_prompts
    assert scheduler_config(build_parser().parse_args(base), 4096).spread_prompts


def test_a_local_cluster_defaults_to_a_cpu_sized_budget(tmp_path: Path) -> None:
    """A decode riding with a prompt chunk waits for the whole micro-batch: on one CPU core per
    stage a 512-token chunk is ~200 ms a stage, so `up --local` (CPU workers only) takes 128."""
    (tmp_path / "config.json").write_text("{}")
    parser = argparse.ArgumentParser()
    up.add_cluster_flags(parser)
    args = parser.parse_args(["--model", str(tmp_path)])
    assert args.budget == 128
    assert up.cluster_config(args, port=1).budget_tokens == 128
    assert LocalClusterConfig(model_dir=str(tmp_path)).budget_tokens == 128


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "no-kernels"])
def test_up_says_what_it_chose_and_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kernels: bool, dtype: str
) -> None:
    """Without tune-layout's measurement: one worker on every core wherever the package's
    kernels load, in either dtype (PP=1 beat PP=2 in float32 on the AVX2 EPYCs and in bf16 on
    the Zen 5 EPYC), the pipeline elsewhere."""
    (tmp_path / "config.json").write_text("{}")
    parser = argparse.ArgumentParser()
    up.add_cluster_flags(parser)
    up.add_budget_flags(parser)
    parser.set_defaults(pp=None, budget=None, idle_budget=None)  # as `up` registers it
    monkeypatch.setattr(layout_choice, "default_dtype", lambda _device: dtype)
    # a CPU the rule was measured on in this dtype: an AVX2 EPYC, the Zen 5 EPYC
    measured_on = {"float32": "avx2", "bfloat16": "avx2 avx512f avx512_bf16"}
    cpu = layout_choice.CpuId("AuthenticAMD", frozenset(measured_on[dtype].split()))
    monkeypatch.setattr(layout_choice, "read_cpu_id", lambda: cpu)
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr("sarathictl.local_devices.SYSFS_CPUS", tmp_path / "no-topology")
    monkeypatch.setattr("stage_worker.native.fused_kernels", lambda: object() if kernels else None)
    args = parser.parse_args(["--model", str(tmp_path)])
    assert up.cluster_config(args, port=0).dtype == dtype
    said = up.describe_layout(up.cluster_config(args, port=0), args)
    why_dtype = {
        "float32": "float32: this CPU has neither AVX512-BF16 nor AMX",
        "bfloat16": "bfloat16: this CPU computes bf16 natively",
    }
    assert why_dtype[dtype] in said
    assert up.cluster_config(args, port=0).budget_tokens == (64 if kernels else 128)
    # PP=1 alone takes large chunks while nothing decodes; a pipeline overlaps them instead
    assert up.cluster_config(args, port=0).idle_budget_tokens == (512 if kernels else 0)
    if kernels:  # the package's kernels: one worker on both cores
        assert "PP=1 x TP=1 on 2 cores" in said
        assert "2 torch thread(s) per worker" in said
        assert "PP=1, one worker on every core" in said and "--pp 2" in said
        assert "in bf16 on the Zen 5 EPYC" in said
        assert "budget 64: on the AVX2 EPYC 64-token chunks" in said
        assert "`sarathictl tune-layout` fits a larger one" in said
        assert "idle budget 512: while nothing decodes" in said
        assert "extrapolated" not in said
        assert "pinned" not in said  # one worker: it has every core
        off = parser.parse_args(["--model", str(tmp_path), "--idle-budget", "0"])
        assert up.cluster_config(off, port=0).idle_budget_tokens == 0
        assert "idle budget" not in up.describe_layout(up.cluster_config(off, port=0), off)
        whole = parser.parse_args(["--model", str(tmp_path), "--policy", "vllm"])
        assert up.cluster_config(whole, port=0).idle_budget_tokens == 0  # it does not chunk
        slo = parser.parse_args(["--model", str(tmp_path), "--tbt-slo", "0.3"])
        assert up.cluster_config(slo, port=0).idle_budget_tokens == 0  # the budget is not known
    else:
        assert "PP=2 x TP=1 on 2 cores" in said
        assert "1 torch thread(s) per worker" in said
        assert "LM head's stage holds fewer" in said
        assert "each worker pinned to its own core(s), by rank: 0, 1 (--no-pin-cpus" in said
        floating = parser.parse_args(["--model", str(tmp_path), "--no-pin-cpus"])
        assert "pinned" not in up.describe_layout(up.cluster_config(floating, port=0), floating)
    flags = ["--model", str(tmp_path), "--threads", "2", "--dtype", "float32"]
    # A depth given: the budgets measured for that depth go with it (`bench-vs-vllm`'s
    # sarathi-pp1 is then up's own layout), whichever depth the rule would have picked.
    same, other = ("1", "2") if kernels else ("2", "1")
    config = up.cluster_config(parser.parse_args([*flags, "--pp", same]), port=0)
    measured = (64, 512) if kernels else (128, 0)
    assert (config.budget_tokens, config.idle_budget_tokens) == measured
    chosen = parser.parse_args([*flags, "--pp", other, "--budget", "96", "--idle-budget", "0"])
    config = up.cluster_config(chosen, port=0)
    assert (config.budget_tokens, config.idle_budget_tokens) == (96, 0)
    said = up.describe_layout(config, chosen)
    assert said == f"layout: PP={other} x TP=1 on 2 cores, cpu" + (
        "\n  layers: the LM head's stage holds fewer (--layer-split to choose)" if kernels else ""
    )  # nothing chosen for the user but the split
    config = up.cluster_config(parser.parse_args([*flags, "--pp", other]), port=0)
    other_layout = layout_choice.LAYOUTS[int(other)]
    assert (config.budget_tokens, config.idle_budget_tokens) == (
        other_layout.budget_tokens,
        other_layout.idle_budget_tokens,
    )
    assert (config.budget_tokens, config.idle_budget_tokens) == ((128, 0) if kernels else (64, 512))


@pytest.mark.parametrize(
    ("vendor", "flags", "dtype", "measured"),
    [
        ("AuthenticAMD", "avx2 fma", "float32", True),  # the AVX2 EPYCs
        ("AuthenticAMD", "avx2 avx512f avx512_bf16", "bfloat16", True),  # the Zen 5 EPYC
        ("GenuineIntel", "avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "bfloat16", False),
        ("GenuineIntel", "avx2 fma", "float32", False),  # another maker's AVX2
        ("AuthenticAMD", "avx2 avx512f avx512_bf16", "float32", False),
        ("AuthenticAMD", "avx2 fma", "bfloat16", False),
        ("AuthenticAMD", "sse2", "float32", False),  # no AVX2
        ("", "", "float32", False),  # a CPU that says nothing
    ],
)
def test_the_pp1_rule_says_where_it_is_extrapolated(
    monkeypatch: pytest.MonkeyPatch, vendor: str, flags: str, dtype: str, measured: bool
) -> None:
    """PP=1 beat PP=2 on the CPUs measured, in the dtype each ran; on another kind of CPU, or
    in another dtype, up says that its pick is extrapolated and how to measure it."""
    monkeypatch.setattr("stage_worker.native.fused_kernels", lambda: object())
    cpu = layout_choice.CpuId(vendor, frozenset(flags.split()))
    layout = layout_choice.default_layout("cpu", dtype, cpu)
    assert layout.pp == 1
    assert ("extrapolated" in layout.why) != measured
    if not measured:
        assert f"in {dtype}, so extrapolated here (`sarathictl tune-layout`" in layout.why
    if "amx_bf16" in flags:
        assert "not yet measured on an Intel CPU with AMX in bfloat16" in layout.why
    assert layout_choice.default_layout("cpu").why == layout_choice.PP1_LAYOUT.why  # no dtype


def test_the_cpu_is_read_from_its_vendor_and_flags_lines(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon with avx2 in its name\n"
        "flags\t\t: fpu amx_bf16 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    )
    cpu = layout_choice.read_cpu_id(str(cpuinfo))
    assert cpu == layout_choice.CpuId("GenuineIntel", frozenset({"fpu", "amx_bf16", "amx_tile"}))
    assert layout_choice.read_cpu_id(str(tmp_path / "missing")) == layout_choice.CpuId(
        "", frozenset()
    )


def test_the_demo_and_the_benchmarks_keep_the_pipeline(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    parser = argparse.ArgumentParser()
    up.add_cluster_flags(parser)
    assert up.cluster_config(parser.parse_args(["--model", str(tmp_path)]), port=0).pp == 2


def test_worker_flags_reach_every_worker_and_only_known_ones(tmp_path: Path) -> None:
    from stage_worker.__main__ import build_parser

    (tmp_path / "config.json").write_text("{}")
    parser = argparse.ArgumentParser()
    up.add_cluster_flags(parser)
    model = ["--model", str(tmp_path)]
    assert up.cluster_config(parser.parse_args(model), port=0).extra_worker_args == ()
    args = parser.parse_args(
        [*model, "--worker-flag=--no-cpu-layer-loop", "--worker-flag=--no-fused-ops"]
    )
    assert up.cluster_config(args, port=0).extra_worker_args == (
        "--no-cpu-layer-loop",
        "--no-fused-ops",
    )
    with pytest.raises(SystemExit):  # up sets the rest itself: a second --model would fight it
        parser.parse_args([*model, "--worker-flag=--model"])
    # every switch passed on is one the worker takes, with its value as argparse reads it
    worker = build_parser()
    for flag in up.WORKER_FLAGS:
        parsed = worker.parse_args(["--controller", "tcp://x:1", "--model", "m", flag])
        dest = flag.removeprefix("--").removeprefix("no-").replace("-", "_")
        assert getattr(parsed, dest) is (not flag.startswith("--no-"))


@pytest.mark.parametrize(
    ("host", "dialed"),
    [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::", "[::1]"), ("::1", "[::1]"),
     ("10.0.0.5", "10.0.0.5"), ("node-1", "node-1")],
)  # fmt: skip
def test_a_client_here_dials_loopback_for_a_wildcard_host(host: str, dialed: str) -> None:
    assert connect_host(host) == dialed


def test_decodes_go_ahead_unless_asked_not_to() -> None:
    """On by default, on a CPU too (measured: sessions 38 and 39); up says which and why, and
    passes the controller a flag only when asked to wait for each token."""
    import argparse

    from controller.__main__ import build_parser, scheduler_config

    assert up.decode_ahead_for(None)[0] is True
    assert "--no-decode-ahead" in up.decode_ahead_for(None)[1]
    assert up.decode_ahead_for(False) == (False, "as asked")
    parser = argparse.ArgumentParser()
    up.add_budget_flags(parser)
    parser.set_defaults(device="cpu", decode_ahead=None)
    assert up.budget_args(parser.parse_args([])) == ()
    assert up.budget_args(parser.parse_args(["--decode-ahead"])) == ()
    assert up.budget_args(parser.parse_args(["--no-decode-ahead"])) == ("--no-decode-ahead",)
    base = ["--model", "m", "--pp", "1"]
    off = build_parser().parse_args([*base, "--no-decode-ahead"])
    assert not scheduler_config(off, 4096).decode_ahead
    assert scheduler_config(build_parser().parse_args(base), 4096).decode_ahead
    # a pipeline never goes ahead, whatever the flag says
    assert not scheduler_config(
        build_parser().parse_args(["--model", "m", "--pp", "2"]), 4096
    ).decode_ahead
