"""The pipeline bubbles of `make bench-vs-vllm` (tools/bench_vs_vllm/bubbles.py and
stage_hook/): each server's stage steps, read back and measured against the client's requests.
The hook runs in a real Python process against a stand-in for vLLM's worker module."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from controller.executor.simulated import steady_window
from controller.scheduler import MicroBatch
from controller.step_log import StepLog
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))  # bench_vs_vllm is a folder there, not installed

from bench_vs_vllm.bubbles import (
    busy_in,
    lone_fraction,
    lone_spans,
    request_spans,
    run_bubbles,
    stage_steps,
)
from bench_vs_vllm.results import Row, bubble_table, load_row, stages_path
from bench_vs_vllm.servers import STAGE_HOOK, STEP_LOG, sarathi_spec, vllm_spec


def test_a_stage_waiting_while_requests_are_in_is_a_bubble_and_an_empty_system_is_not() -> None:
    # requests in the system during [0, 4] and [6, 10]: 8 s of work, 2 s with nothing to do
    spans = [(0.0, 4.0), (6.0, 10.0)]
    busy_all_along = [(4.0, 4.0), (10.0, 4.0)]  # busy whenever there was work
    half_busy = [(2.0, 2.0), (10.0, 2.0)]  # 4 s busy: 4 s waiting with work there
    measured = run_bubbles([busy_all_along, half_busy], spans)
    assert measured.stage_busy_s == (8.0, 4.0)
    assert measured.bubble_fraction == pytest.approx((0.0 + 0.5) / 2)  # the mean over stages


def test_busy_time_is_cut_at_the_window() -> None:
    steps = [(1.0, 1.0), (3.0, 0.5), (9.0, 2.0)]  # busy [0, 1], [2.5, 3], [7, 9]
    assert busy_in(steps, 0.5, 8.0) == pytest.approx(0.5 + 0.5 + 1.0)


def test_the_steady_state_leaves_out_the_ramp_and_the_drain() -> None:
    # 11 requests a second apart, 1 s each; the stage idles through the first and the last
    spans = [(float(t), float(t) + 1.0) for t in range(11)]
    steps = [(float(t) + 1.0, 1.0) for t in range(1, 10)]
    measured = run_bubbles([steps], spans)
    assert measured.bubble_fraction == pytest.approx(2 / 11)
    assert measured.steady_bubble_fraction == pytest.approx(0.0)
    at_once = [(0.001 * i, 5.0) for i in range(11)]  # rate inf: every request at the start
    assert math.isnan(run_bubbles([[(5.0, 5.0)]], at_once).steady_bubble_fraction)


def test_the_stretches_with_one_request_alone() -> None:
    # one request over [0, 10], a second over [2, 4], a third from 10 (as the first ends) to 12
    spans = [(0.0, 10.0), (2.0, 4.0), (10.0, 12.0)]
    assert lone_spans(spans, 0.0, 12.0) == [(0.0, 2.0), (4.0, 10.0), (10.0, 12.0)]
    assert lone_spans(spans, 1.0, 11.0) == [(1.0, 2.0), (4.0, 10.0), (10.0, 11.0)]
    assert lone_spans([(0.0, 5.0), (0.0, 5.0)], 0.0, 5.0) == []  # never alone


def test_the_bubble_with_a_request_alone_is_told_apart() -> None:
    """Two stages, 21 requests a second apart: the first 11 are alone for 1 s each (a pipeline
    can hold one micro-batch then, so one stage waits while the other runs it), the next 10
    overlap in pairs. The lone part is the idle time while one request was alone."""
    alone = [(float(t), float(t) + 1.0) for t in range(11)]
    paired = [(11.0 + 2 * k, 13.0 + 2 * k) for k in range(5)] * 2  # two at once, back to back
    spans = alone + paired  # the system is never empty in [0, 21]
    # a request alone: each stage busy half of every second; two at once: both busy throughout
    stage0 = [(t + 0.5, 0.5) for t in range(11)] + [(21.0, 10.0)]
    stage1 = [(t + 1.0, 0.5) for t in range(11)] + [(21.0, 10.0)]
    measured = run_bubbles([stage0, stage1], spans)
    whole = lone_fraction([stage0, stage1], spans, 0.0, 21.0)
    assert whole == pytest.approx(5.5 / 21)  # 11 s alone, half of it idle, over 21 s of work
    assert measured.bubble_fraction == pytest.approx(whole)  # every bubble here is a lone one
    # the steady state is [2, 17] (the arrivals' middle 80%): 9 s alone, half of it idle, over
    # 15 s with requests in the system
    assert steady_window(sorted(start for start, _ in spans)) == (2.0, 17.0)
    assert measured.steady_lone_fraction == pytest.approx(4.5 / 15)
    assert measured.steady_lone_fraction == pytest.approx(measured.steady_bubble_fraction)
    # a stage busy while no request is in the system has less bubble than idle time, and the
    # lone part is never more than the bubble it is part of: two lone requests, [0, 4] and
    # [6, 10], the stage busy over [4, 6] (between them) and [8, 10] only: idle 6 s of the 8
    # alone, but 4 s busy against 8 s of work is a bubble of 4 s
    gap_spans, busy_in_gap = [(0.0, 4.0), (6.0, 10.0)], [(6.0, 2.0), (10.0, 2.0)]
    assert run_bubbles([busy_in_gap], gap_spans).bubble_fraction == pytest.approx(0.5)
    assert lone_fraction([busy_in_gap], gap_spans, 0.0, 10.0) == pytest.approx(0.5)


def test_a_detailed_result_gives_each_requests_span() -> None:
    assert request_spans({"start_times": [10.0, 11.5], "latencies": [2.0, 0.5]}) == [
        (10.0, 12.0),
        (11.5, 12.0),
    ]
    with pytest.raises(ValueError, match="save-detailed"):
        request_spans({"latencies": [1.0]})


def test_our_step_log_gives_each_stages_steps_on_the_clock_the_client_reads(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "sarathi-pp2"
    folder.mkdir()
    with open(folder / STEP_LOG, "w") as out:
        log = StepLog(out, num_stages=2)
        log.sent(MicroBatch(1, [], [], 0), at=time.perf_counter())
        log.stage_reported(0, 1, step_s=0.030, prepare_s=0.0, recv_wait_s=0.0)
        log.stage_reported(1, 1, step_s=0.050, prepare_s=0.0, recv_wait_s=0.020)
        log.returned(1, at=time.perf_counter())
    now = time.perf_counter()
    (stage0,), (stage1,) = stage_steps(folder)
    assert (stage0[1], stage1[1]) == pytest.approx((0.030, 0.030))  # less the wait
    assert now - 5.0 < stage0[0] <= now  # perf_counter seconds, not the log's own


FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/distributed/__init__.py": """
        class _Group:
            rank_in_group = 1
        def get_pp_group():
            return _Group()
    """,
    # the classes and methods as vLLM 0.32 has them, their work and waits as sleeps
    "vllm/distributed/parallel_state.py": """
        import time
        class GroupCoordinator:
            def irecv_tensor_dict(self):
                time.sleep(0.1)  # the metadata's receive: until the stage before sends
                return {}, [], []
    """,
    "vllm/v1/__init__.py": "",
    "vllm/v1/worker/__init__.py": "",
    "vllm/v1/worker/gpu_worker.py": """
        import time
        from vllm.distributed.parallel_state import GroupCoordinator
        class AsyncIntermediateTensors:
            def wait_for_comm(self):
                time.sleep(0.1)  # the activations themselves arrive
        class Worker:
            _pp_send_work = []
            def execute_model(self, scheduler_output):
                GroupCoordinator().irecv_tensor_dict()
                AsyncIntermediateTensors().wait_for_comm()
                time.sleep(0.05)  # the forward
                return "output"
            def sample_tokens(self, grammar_output):
                time.sleep(0.02)
                return "tokens"
    """,
}


def test_the_hook_times_vllms_steps_less_their_waits_in_a_real_process(tmp_path: Path) -> None:
    for name, text in FAKE_VLLM.items():
        path = tmp_path / "fake" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    logs = tmp_path / "vllm-pp2"
    logs.mkdir()
    script = textwrap.dedent("""
        from types import SimpleNamespace
        from vllm.v1.worker.gpu_worker import Worker
        worker = Worker()
        assert worker.execute_model(SimpleNamespace(total_num_scheduled_tokens=9)) == "output"
        assert worker.sample_tokens(None) == "tokens"
        worker.execute_model(SimpleNamespace(total_num_scheduled_tokens=0))  # no forward
    """)
    env = {
        **os.environ,
        "PYTHONPATH": f"{STAGE_HOOK}{os.pathsep}{tmp_path / 'fake'}",
        "SARATHI_BENCH_STAGE_LOG": str(logs),
    }
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    (steps,) = stage_steps(logs)  # rank 1 alone: one stage's process
    assert len(steps) == 2  # the forward and the sampling; the empty step is none
    (forward_end, forward_busy), (_, sample_busy) = steps
    # 0.05 s of work, not with the 0.2 s of waits before it (the bound below 0.25 leaves a
    # loaded machine room to oversleep)
    assert 0.04 < forward_busy < 0.22
    assert 0.015 < sample_busy < 0.2
    assert abs(forward_end - time.perf_counter()) < 60  # the machine's one monotonic clock


def test_without_the_variable_the_hook_does_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(STAGE_HOOK)}
    env.pop("SARATHI_BENCH_STAGE_LOG", None)
    check = (
        "import sys; assert not any(type(f).__name__ == '_PatchOnImport' for f in sys.meta_path)"
    )
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=60)


def test_pipelines_are_timed_and_the_bubbles_come_back_with_the_run(tmp_path: Path) -> None:
    ours = sarathi_spec(Path("sarathictl"), Path("/m/demo"), 8200, "float32", stage_logs=tmp_path)
    assert ours.stage_log == tmp_path / "sarathi"
    assert ours.command[ours.command.index("--step-log") + 1] == str(
        tmp_path / "sarathi" / STEP_LOG
    )
    theirs = vllm_spec(Path("vllm"), Path("/m/demo"), "demo", 8100, 1, "float32", pp=2,
                       stage_logs=tmp_path)  # fmt: skip
    assert theirs.stage_log == tmp_path / "vllm-pp2"
    assert theirs.env["SARATHI_BENCH_STAGE_LOG"] == str(tmp_path / "vllm-pp2")
    assert theirs.env["PYTHONPATH"] == str(STAGE_HOOK)
    single = vllm_spec(Path("vllm"), Path("/m/demo"), "demo", 8100, 1, "float32",
                       stage_logs=tmp_path)  # fmt: skip
    assert single.stage_log is None and "PYTHONPATH" not in single.env  # one stage: untimed
    assert not any(tmp_path.iterdir())  # folders are made when a server starts, not before

    result = tmp_path / "vllm-pp2_random-384-96_1qps.json"
    result.write_text(json.dumps({"request_rate": 1.0, "completed": 4}))
    assert math.isnan(load_row(result, "vllm-pp2", "random-384-96").bubble_fraction)
    saved = {"bubble_fraction": 0.25, "steady_bubble_fraction": 0.125}
    stages_path(result).write_text(json.dumps(saved))  # from before the lone share was saved
    timed = load_row(result, "vllm-pp2", "random-384-96")
    assert (timed.bubble_fraction, timed.steady_bubble_fraction) == (0.25, 0.125)
    assert "| 25.0% | 12.5% | n/a |" in bubble_table([timed])
    stages_path(result).write_text(json.dumps({**saved, "steady_lone_fraction": 0.05}))
    timed = load_row(result, "vllm-pp2", "random-384-96")
    untimed = Row("vllm", "random-384-96", 1.0, 4, 0, *[1.0] * 9)
    table = bubble_table([timed, untimed])
    assert "| random-384-96 | 1 | vllm-pp2 | 25.0% | 12.5% | 5.0% |" in table
    assert "| vllm |" not in table and bubble_table([untimed]) == ""
