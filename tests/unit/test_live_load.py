"""Live runs: metrics from what the client saw and the stages reported, probe sizes, and the
benchmark model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from sarathictl.bench.live_capacity import MIN_PROBE_REQUESTS, cap_probe
from sarathictl.bench.live_load import LiveRecord, LiveRun, scale_requests
from sarathictl.bench.metrics import BusyWindow, union_s
from sarathictl.cli import main

from controller.executor.simulated import SimRequest


def test_live_metrics_use_client_token_times_and_stage_busy_seconds() -> None:
    records = [
        LiveRecord(arrival_s=0.0, first_token_s=0.5, finish_s=0.9, scheduling_delay_s=0.1,
                   num_prompt_tokens=10, num_output_tokens=3, gaps_s=[0.1, 0.3]),
        LiveRecord(arrival_s=1.0, first_token_s=1.2, finish_s=1.5, scheduling_delay_s=0.3,
                   num_prompt_tokens=20, num_output_tokens=2, gaps_s=[0.2]),
    ]  # fmt: skip
    run = LiveRun(records, start_s=0.0, end_s=2.0, stage_busy_s=[0.7, 1.0], num_preemptions=0)
    m = run.metrics()
    assert m.num_requests == 2 and not m.stopped_early
    assert m.ttft_p50_s == 0.35  # (0.5 + 0.2) / 2
    assert m.scheduling_delay_p50_s == 0.2
    assert m.tbt_p50_s == 0.2  # every gap is a sample: 0.1, 0.2, 0.3
    assert m.throughput_tokens_s == 17.5
    # 1.4 s of the 2 s had a request in the system: the other 0.6 s is idle, not bubble
    assert m.stage_utilization == pytest.approx((0.35, 0.5))
    assert m.stage_bubble == pytest.approx((0.35, 0.2))
    assert m.stage_idle == pytest.approx((0.3, 0.3))
    assert m.bubble_fraction == pytest.approx((0.35 / 0.7 + 0.2 / 0.7) / 2)
    assert math.isnan(m.steady_bubble_fraction)  # no steady window measured


def test_steady_state_bubble_counts_only_its_window() -> None:
    records = [
        LiveRecord(arrival_s=0.0, first_token_s=0.5, finish_s=0.9, num_output_tokens=1),
        LiveRecord(arrival_s=1.0, first_token_s=1.2, finish_s=1.5, num_output_tokens=1),
    ]
    steady = BusyWindow(0.0, 1.0, (0.5, 0.9))
    run = LiveRun(records, 0.0, 2.0, [0.7, 1.0], 0, steady=steady)
    # 0.9 s of work in the window: stage 0 waited 0.4 s of it, stage 1 none
    assert run.metrics().steady_bubble_fraction == pytest.approx((0.4 / 0.9 + 0.0) / 2)


def test_union_of_request_spans_within_a_window() -> None:
    spans = [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5), (6.0, 9.0)]
    assert union_s(spans, 0.0, 10.0) == pytest.approx(6.0)
    assert union_s(spans, 1.5, 7.0) == pytest.approx(0.5 + 1.0 + 1.0)
    assert union_s([], 0.0, 1.0) == 0.0


def test_a_failed_request_fails_the_run() -> None:
    run = LiveRun([LiveRecord(arrival_s=0.0, error="UNAVAILABLE: down")], 0.0, 1.0, [0.5], 0)
    assert run.num_errors == 1 and run.metrics().stopped_early
    assert not run.metrics().meets(tbt_slo_s=10.0)


def test_scaling_a_trace_keeps_every_request_at_least_one_token_and_within_the_cap() -> None:
    scaled = scale_requests([SimRequest(0.0, 1000, 100), SimRequest(1.0, 2, 1)], 0.1, 50)
    assert scaled == [SimRequest(0.0, 40, 10), SimRequest(1.0, 1, 1)]


def test_a_probe_at_a_low_rate_replays_only_its_first_seconds() -> None:
    requests = [SimRequest(float(t), 8, 4) for t in range(100)]  # one arrival a second
    assert [r.arrival_s for r in cap_probe(requests, 30.0)] == [float(t) for t in range(31)]
    assert len(cap_probe(requests, 2.0)) == MIN_PROBE_REQUESTS  # never fewer than this
    assert cap_probe(requests, 0.0) == requests  # 0: no cap


def test_random_falcon_command_writes_a_servable_folder(tmp_path: Path) -> None:
    out = tmp_path / "falcon"
    argv = ["model", "random-falcon", str(out), "--hidden-size", "64", "--num-layers", "2",
            "--num-heads", "4", "--num-kv-heads", "2", "--vocab-size", "320"]  # fmt: skip
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)
    assert config["new_decoder_architecture"] is True
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "tokenizer.json"}


def test_random_falcon_names_the_bad_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "f")
    assert main(["model", "random-falcon", out, "--num-heads", "8", "--num-kv-heads", "3"]) == 2
    assert "num_attention_heads must be a multiple of num_kv_heads" in capsys.readouterr().err
    assert main(["model", "random-falcon", out, "--num-layers", "0"]) == 2
    assert "argument --num-layers: must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "f").exists()  # nothing half-written


def test_a_small_sarathi_budget_caps_the_running_sequences_instead_of_failing(
    tmp_path: Path,
) -> None:
    from sarathictl.bench.live_capacity import with_budget
    from sarathictl.local_cluster import LocalClusterConfig

    (tmp_path / "config.json").write_text("{}")
    model = str(tmp_path)
    base = LocalClusterConfig(model_dir=model, max_num_seqs=128)
    assert with_budget(base, 64).max_num_seqs == 64  # sarathi: every decode fits a micro-batch
    vllm = with_budget(LocalClusterConfig(model_dir=model, policy="vllm", max_num_seqs=128), 64)
    assert (vllm.budget_tokens, vllm.max_num_seqs) == (64, 128)


def test_warmup_serves_the_longest_and_shortest_prompts_within_their_own_lengths() -> None:
    from sarathictl.bench.live_capacity import WARMUP_OUTPUT_TOKENS, warmup_requests

    requests = [SimRequest(1.0, 500, 3), SimRequest(2.0, 40, 200), SimRequest(3.0, 900, 100)]
    assert warmup_requests(requests) == [
        SimRequest(0.0, 900, WARMUP_OUTPUT_TOKENS),
        SimRequest(0.0, 40, WARMUP_OUTPUT_TOKENS),
    ]
    assert warmup_requests([SimRequest(0.0, 8, 3)]) == [SimRequest(0.0, 8, 3)] * 2


def test_the_strict_slo_is_measured_on_the_first_policys_cluster_where_it_is_that_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from sarathictl.bench import live_capacity
    from sarathictl.local_cluster import LocalClusterConfig

    started: list[object] = []

    class StandIn:
        def __init__(self, config: LocalClusterConfig) -> None:
            self.config = config
            started.append(config)

        def __enter__(self) -> StandIn:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(live_capacity, "LocalCluster", StandIn)
    monkeypatch.setattr(live_capacity, "decode_step_s", lambda cluster: 0.02)
    (tmp_path / "config.json").write_text("{}")
    chunked = LocalClusterConfig(model_dir=str(tmp_path), pp=1, budget_tokens=512)
    whole = LocalClusterConfig(model_dir=str(tmp_path), pp=1, policy="vllm", budget_tokens=8192)

    slo = live_capacity.TbtSlo("strict", chunked)
    assert slo.on(StandIn(chunked)) == pytest.approx(0.1)  # 5x the step, on that cluster
    assert slo.on(StandIn(whole)) == pytest.approx(0.1)  # known: not measured again
    assert started == [chunked, whole]  # the two stand-ins above, no cluster of its own

    slo = live_capacity.TbtSlo("relaxed", chunked)
    assert slo.on(StandIn(whole)) == pytest.approx(0.5)  # 25x, on a cluster started for it
    assert started[2:] == [whole, chunked]
    assert live_capacity.TbtSlo(0.25, chunked).on(StandIn(whole)) == 0.25
