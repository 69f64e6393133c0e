"""Capacity search, the CLI commands and the BENCHMARKS.md section."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sarathictl.bench.capacity import search_capacity
from sarathictl.bench.metrics import summarize
from sarathictl.bench.paper_report import BEGIN, END, write_section
from sarathictl.cli import main

from controller.executor.simulated import SimRequest, SimulatedPipeline, run_simulation
from controller.scheduler import CacheConfig, MicroBatch, Scheduler, SchedulerConfig
from controller.simulator import StageCost


@pytest.mark.parametrize("capacity", [0.02, 3.7, 250.0])
def test_search_finds_a_known_threshold_to_the_granularity(capacity: float) -> None:
    result = search_capacity(lambda qps: qps <= capacity, initial_qps=1.0, granularity=0.025)
    assert capacity * (1 - 0.025) <= result.capacity_qps <= capacity
    assert result.upper_qps > capacity
    assert len(result.probes) < 20


def test_search_reports_zero_when_nothing_passes() -> None:
    assert search_capacity(lambda qps: False, min_qps=0.01).capacity_qps == 0.0


class ProbeClock:
    """A clock that each probe moves on by `probe_s`: a search's time, with no waiting."""

    def __init__(self, capacity: float, probe_s: float) -> None:
        self.capacity, self.probe_s, self.now = capacity, probe_s, 0.0

    def __call__(self) -> float:
        return self.now

    def passes(self, qps: float) -> bool:
        self.now += self.probe_s
        return qps <= self.capacity


def test_a_time_limit_ends_the_search_with_the_bracket_found() -> None:
    clock = ProbeClock(capacity=3.7, probe_s=10.0)
    result = search_capacity(clock.passes, 1.0, 0.025, time_limit_s=45.0, clock=clock)
    # 1 and 2 pass, 4 fails, 3 passes; a fifth probe would end at 50 s, past the limit.
    assert result.probes == [(1.0, True), (2.0, True), (4.0, False), (3.0, True)]
    assert (result.capacity_qps, result.upper_qps, result.converged) == (3.0, 4.0, False)


def test_a_search_within_its_time_limit_converges() -> None:
    clock = ProbeClock(capacity=3.7, probe_s=10.0)
    unlimited = search_capacity(clock.passes, 1.0, 0.025)
    clock.now = 0.0
    limited = search_capacity(clock.passes, 1.0, 0.025, time_limit_s=1e4, clock=clock)
    assert limited == unlimited
    assert limited.converged


def test_a_search_out_of_time_before_any_pass_reads_zero() -> None:
    clock = ProbeClock(capacity=0.1, probe_s=10.0)
    result = search_capacity(clock.passes, 1.0, time_limit_s=15.0, clock=clock)
    assert result.probes == [(1.0, False)]
    assert (result.capacity_qps, result.upper_qps, result.converged) == (0.0, 1.0, False)


class FixedStepTime:
    """A one-stage executor that serves one request per step_s: capacity 1 / step_s."""

    num_stages = 1

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def micro_batch_cost(self, batch: MicroBatch) -> StageCost:
        return StageCost([self.step_s], 0.0)


def test_capacity_of_an_executor_with_known_capacity() -> None:
    # Prompts fill the whole budget and generate one token: one request per 0.1 s step.
    unit_arrivals = np.random.default_rng(0).exponential(1.0, 1500).cumsum().tolist()

    def passes(qps: float) -> bool:
        config = SchedulerConfig(policy="sarathi", budget_tokens=64, max_num_seqs=8)
        scheduler = Scheduler(config, CacheConfig(num_blocks=512))
        requests = [SimRequest(t / qps, 64, 1) for t in unit_arrivals]
        result = run_simulation(
            scheduler, SimulatedPipeline(FixedStepTime(0.1)), requests, stop_delay_s=2.0
        )
        return summarize(result).meets(tbt_slo_s=1.0)

    result = search_capacity(passes, initial_qps=1.0)
    assert 8.5 <= result.capacity_qps <= 10.5


def test_simulate_command_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "simulate", "--model", "falcon-180b", "--gpu", "a100", "--tp", "4"]
    argv += ["--pp", "2", "--link", "eth-100g", "--policy", "sarathi", "--budget", "512"]
    argv += ["--trace", "arxiv", "--qps", "0.1", "--num-requests", "16", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["metrics"]["num_requests"] == 16
    assert len(report["metrics"]["stage_utilization"]) == 2


def test_capacity_command_ranks_policies(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "capacity", "--model", "mistral-7b", "--policies", "sarathi,vllm"]
    argv += ["--tbt-slo", "0.1", "--trace", "arxiv", "--num-requests", "200", "--json"]
    assert main(argv) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert rows["vllm"]["ratio_to_vllm"] == 1.0
    assert rows["sarathi"]["capacity_qps"] > rows["vllm"]["capacity_qps"] > 0


def test_bad_layout_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "simulate", "--model", "falcon-180b", "--gpu", "a40", "--tp", "2"]
    assert main(argv) == 2
    assert "cannot hold falcon-180b on a40" in capsys.readouterr().err
    assert main(["bench", "simulate", "--gpu", "tpu"]) == 2
    assert "known: a100, a40, h100" in capsys.readouterr().err


def test_section_replaces_only_its_own_markers(tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(f"# Benchmarks\n\nlead's text\n\n{BEGIN}\nold\n{END}\n\n## other\nkept\n")
    row = {
        "group": "main",
        "label": "M",
        "slo": "strict",
        "tbt_slo_s": 0.1,
        "model": "mistral-7b",
        "workload": "arxiv",
        "budget_tokens": 512,
    }
    capacity = [
        dict(row, policy=p, capacity_qps=q)
        for p, q in (("sarathi", 2.0), ("vllm", 1.0), ("orca", 0.5))
    ]
    report = {
        "capacity": capacity,
        "ablation": [],
        "workloads": ["arxiv"],
        "wall_s": 1.0,
        "num_requests": 10,
        "seed": 0,
    }
    write_section(path, report)
    text = path.read_text()
    assert text.startswith("# Benchmarks\n\nlead's text\n\n" + BEGIN)
    assert text.endswith(f"{END}\n\n## other\nkept\n")
    assert "old" not in text
    assert "| 2.000 | 1.000 | 0.500 | 2.00x | 4.00x |" in text
