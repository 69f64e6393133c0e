"""`python -m bench_vs_vllm.pipeline_bound`: a run's time split into the stages' mean work, the
layer split, dependencies, trips and time with no requests, by replaying its micro-batches from
a step log written as the controller writes it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))  # bench_vs_vllm is a folder there, not installed

from bench_vs_vllm.bubbles import read_step_log
from bench_vs_vllm.pipeline_bound import (
    PARTS,
    all_bound_tables,
    bound_table,
    main,
    pipeline_times,
    split_what_if,
)
from bench_vs_vllm.servers import STEP_LOG

OPENED_AT_S = 100.0


def step_line(sent: float, returned: float, stages: list[tuple[float, float]]) -> str:
    """A step-log line (controller/step_log.py): times since the log opened at OPENED_AT_S;
    each stage's work as (start, end)."""
    return json.dumps({
        "opened_at_s": OPENED_AT_S, "sent_s": sent, "returned_s": returned,
        "prompt_tokens": 0, "decodes": 1,
        "stages": [{"work_s": end - start, "reported_s": end} for start, end in stages],
    })  # fmt: skip


# One request from 0 to 7.6 s. Stage 0 takes 2 s a micro-batch, stage 1 (the lighter) 1 s.
# The first two are sent at once; the third waits for the first's result (read at 3), and the
# controller sends it 1.5 s after that: 0.5 s later than stage 0 could have taken it.
FIRST_RUN = [
    step_line(0.0, 3.0, [(0.0, 2.0), (2.0, 3.0)]),
    step_line(0.0, 5.0, [(2.0, 4.0), (4.0, 5.0)]),
    step_line(4.5, 7.6, [(4.5, 6.5), (6.5, 7.5)]),
]
# A second request arrives at 10 s into an empty pipeline; its micro-batch is sent at 10.2.
SECOND_RUN = [step_line(10.2, 13.3, [(10.2, 12.2), (12.2, 13.2)])]


def write_log(folder: Path, lines: list[str]) -> list:
    log = folder / STEP_LOG
    log.write_text("\n".join(lines) + "\n")
    return read_step_log(log)


def test_a_run_s_time_splits_into_work_layer_split_dependencies_and_trips(
    tmp_path: Path,
) -> None:
    times = pipeline_times(write_log(tmp_path, FIRST_RUN), [(OPENED_AT_S, OPENED_AT_S + 7.6)])
    assert times is not None
    # stage 0 works 6 s, stage 1 3 s: no split of this work ends before 4.5 s, no schedule on
    # these layers before 6; replayed, the third starts on stage 0 at 4 and leaves stage 1 at 7
    assert (times.wall_s, times.mean_work_s, times.bound_s) == pytest.approx((7.6, 4.5, 6.0))
    assert times.replay_s == pytest.approx(7.0)
    shares = times.shares()
    assert list(shares) == list(PARTS)
    expected = {"layer split": 1.5, "dependencies": 1.0, "trips": 0.6, "no requests": 0.0}
    assert shares == pytest.approx({p: s / 7.6 for p, s in expected.items()})
    assert sum(shares.values()) + times.mean_work_s / times.wall_s == pytest.approx(1.0)


def test_the_replay_waits_for_an_arrival_and_time_without_requests_is_not_bubble(
    tmp_path: Path,
) -> None:
    batches = write_log(tmp_path, FIRST_RUN + SECOND_RUN)
    spans = [(OPENED_AT_S, OPENED_AT_S + 7.6), (OPENED_AT_S + 10.0, OPENED_AT_S + 13.3)]
    times = pipeline_times(batches, spans)
    assert times is not None
    # the fourth cannot start before its request arrived (10): the replay ends at 13, the
    # first run's late plan costs nothing (the pipeline would have waited for 10 anyway)
    assert times.replay_s == pytest.approx(13.0)
    assert times.no_requests_s == pytest.approx(2.4)  # 7.6 to 10
    shares = times.shares()
    assert shares["trips"] == pytest.approx(0.3 / 13.3)
    assert shares["dependencies"] == pytest.approx((13.0 - 8.0 - 2.4) / 13.3)
    # a run is the micro-batches sent within its requests' span
    second = pipeline_times(batches, spans[1:])
    assert second is not None and second.wall_s == pytest.approx(3.1)
    assert pipeline_times(batches, [(OPENED_AT_S + 20, OPENED_AT_S + 30)]) is None


def test_the_table_has_a_row_a_run_and_a_missing_log_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "stages" / "sarathi-pp2").mkdir(parents=True)
    write_log(tmp_path / "stages" / "sarathi-pp2", FIRST_RUN)
    (tmp_path / "raw").mkdir()
    run = {"start_times": [OPENED_AT_S], "latencies": [7.6]}
    (tmp_path / "raw" / "sarathi-pp2_random-512-128_2qps.json").write_text(json.dumps(run))
    (tmp_path / "raw" / "sarathi-pp2_random-512-128_2qps.stages.json").write_text("{}")
    table = bound_table(tmp_path, "sarathi-pp2").splitlines()
    assert len(table) == 2 + 1  # header, rule, one run
    # 4.5 of 7.6 s the mean work; 1.5 the split, 1 dependencies, 0.6 trips
    assert table[2] == "| random-512-128_2qps | 7.6 | 59.2% | 19.7% | 13.2% | 7.9% | 0.0% |"
    assert main([str(tmp_path)]) == 0 and "random-512-128_2qps | 7.6 |" in capsys.readouterr().out
    (tmp_path / "stages" / "vllm-pp2").mkdir()  # vLLM's stages have no step log: no table
    assert all_bound_tables(tmp_path) == "sarathi-pp2:\n\n" + "\n".join(table)
    assert all_bound_tables(tmp_path / "elsewhere") == ""
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--system", "sarathi-pp3"])
    assert "no step log" in capsys.readouterr().err


def test_a_layer_moved_is_replayed_as_a_share_of_the_first_stage_s_steps(tmp_path: Path) -> None:
    """Stage 0 of FIRST_RUN (2 s a step) as two layers: half a layer moved evens the stages at
    1.5 s and the replay ends at 6 s, not 7; a whole layer makes stage 1 the heavier (2 s
    against 1) and the replay ends at 7 again."""
    (tmp_path / "stages" / "sarathi-pp2").mkdir(parents=True)
    write_log(tmp_path / "stages" / "sarathi-pp2", FIRST_RUN)
    (tmp_path / "raw").mkdir()
    run = {"start_times": [OPENED_AT_S], "latencies": [7.6]}
    (tmp_path / "raw" / "sarathi-pp2_random-512-128_2qps.json").write_text(json.dumps(run))
    table = split_what_if(tmp_path, "sarathi-pp2", 2, (0.5, 1)).splitlines()
    assert table[0] == "| run | 0.5 layers moved | 1 layers moved |"
    assert table[2] == "| random-512-128_2qps | 0.857x | 1.000x |"
