"""`sarathictl status` tells an operator which stage is down or stalled, and why."""

from __future__ import annotations

from rich.console import Console
from sarathi_proto import generate_pb2
from sarathictl.commands.status import render, stage_label, tp_cell


def rendered(status: generate_pb2.StatusResponse) -> str:
    console = Console(width=80, record=True)
    console.print(render(status))
    return console.export_text()


def test_a_down_and_a_stalled_stage_are_named_with_the_problem() -> None:
    status = generate_pb2.StatusResponse(model="m", serving=False, problem="stage 1 stopped")
    status.stages.add(stage=0, host="10.0.0.1", up=False)
    status.stages.add(stage=1, host="10.0.0.2", up=True, stalled=True)
    text = rendered(status)
    assert "NOT SERVING: stage 1 stopped" in text
    assert "0 DOWN" in text and "1 STALLED" in text and "10.0.0.2" in text


def test_a_stage_whose_worker_still_zeroes_its_kv_cache_says_so() -> None:
    problem = "stage 1 rank 0 (worker w-abc) is still preparing its KV cache"
    status = generate_pb2.StatusResponse(model="m", serving=False, problem=problem)
    status.stages.add(stage=0, host="10.0.0.1", up=True)
    status.stages.add(stage=1, host="10.0.0.2", up=True, preparing_cache=True)
    text = rendered(status)
    assert "NOT SERVING: stage 1 rank 0 (worker w-abc)" in text
    assert [stage_label(s) for s in status.stages] == ["0", "1 PREPARING"]
    # 80 columns: the label may go under the stage's number, in the same cell.
    assert text.count("PREPARING") == 1 and "DOWN" not in text


def test_a_serving_cluster_shows_no_problem_line() -> None:
    status = generate_pb2.StatusResponse(model="m", serving=True)
    status.stages.add(stage=0, host="h", up=True)
    assert "NOT SERVING" not in rendered(status) and "DOWN" not in rendered(status)


def test_each_stage_shows_utilization_bubble_and_idle() -> None:
    status = generate_pb2.StatusResponse(model="m", serving=True)
    status.stages.add(stage=0, up=True, utilization_pct=61.0, bubble_pct=27.5, idle_pct=11.5)
    text = rendered(status)
    assert "bubble %" in text and "idle %" in text
    assert "61.0" in text and "27.5" in text and "11.5" in text


def test_each_stage_shows_the_device_its_workers_run_on() -> None:
    status = generate_pb2.StatusResponse(model="m", serving=True)
    status.stages.add(stage=0, host="10.0.0.1", device="cuda:1", up=True)
    status.stages.add(stage=1, host="10.0.0.2", up=True)  # a worker that named none
    text = rendered(status)  # 80 columns: the device may go under its host, in the same cell
    assert "(cuda:1)" in text
    assert "10.0.0.2 " in text and "10.0.0.2 (" not in text and "()" not in text


def test_the_prefix_cache_shows_its_hit_rates_blocks_and_evictions() -> None:
    status = generate_pb2.StatusResponse(model="m", serving=True)
    status.scheduler.prefix_cache.CopyFrom(
        generate_pb2.PrefixCacheStatus(
            enabled=True,
            num_requests=8,
            num_hit_requests=6,
            num_prompt_tokens=4000,
            num_cached_tokens=3000,
            num_cached_blocks=190,
            num_evictions=12,
        )
    )
    text = rendered(status)
    assert "prefix cache" in text
    assert "75.0" in text and "75.0 of 8" in text  # tokens, requests
    assert "3000/4000" in text and "190" in text and "12" in text


def test_a_prefix_cache_turned_off_says_so() -> None:
    status = generate_pb2.StatusResponse(model="m", serving=True)
    assert "prefix cache: off" in rendered(status)


def test_the_scheduler_shows_its_budgets() -> None:
    status = generate_pb2.StatusResponse(model="m", serving=True)
    status.scheduler.policy = "sarathi"
    status.scheduler.budget_tokens = 64
    assert "(512 idle)" not in rendered(status)
    status.scheduler.idle_budget_tokens = 512
    console = Console(width=120, record=True)  # wide enough that the cell stays on one line
    console.print(render(status))
    assert "64 (512 idle)" in console.export_text()


def test_the_tp_column_shows_the_degree_or_which_ranks_are_connected() -> None:
    status = generate_pb2.StatusResponse(model="m", serving=True)
    status.scheduler.tensor_parallel = 4
    status.stages.add(stage=0, host="h", up=True, tp_ranks=[0, 1, 2, 3])
    status.stages.add(stage=1, host="h", up=False, tp_ranks=[0, 1, 3])
    console = Console(width=120, record=True)
    console.print(render(status))
    text = console.export_text()
    assert "0,1,3 of 4" in text  # rank 2 of stage 1 is missing
    assert tp_cell([0], 1) == "1"  # a TP-1 stage reads as TP 1, not as its rank 0
    assert tp_cell([], 4) == "-"


def test_the_quarantine_is_said_only_while_it_has_something_to_say() -> None:
    status = generate_pb2.StatusResponse(model="m", serving=True)
    status.stages.add(stage=0, host="h", up=True)
    assert "quarantine" not in rendered(status)
    status.scheduler.num_suspects = 2
    status.scheduler.num_quarantined = 1
    text = " ".join(rendered(status).split())
    assert "quarantine: 2 requests run alone, one at a time" in text
    assert "1 ended with an error since start" in text
