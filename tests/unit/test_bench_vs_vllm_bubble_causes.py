"""`python -m bench_vs_vllm.bubble_causes`: each stage's idle time split by what the pipeline
held, from a step log written as the controller writes it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))  # bench_vs_vllm is a folder there, not installed

from bench_vs_vllm.bubble_causes import (
    CAUSES,
    all_causes_tables,
    causes_table,
    idle_causes,
    main,
)
from bench_vs_vllm.bubbles import read_step_log
from bench_vs_vllm.servers import STEP_LOG

OPENED_AT_S = 100.0


def step_line(sent: float, returned: float, stages: list[tuple[float, float]], prompt: int) -> str:
    """A step-log line (controller/step_log.py): times since the log opened at OPENED_AT_S;
    each stage's work as (start, end)."""
    return json.dumps({
        "opened_at_s": OPENED_AT_S, "sent_s": sent, "returned_s": returned,
        "prompt_tokens": prompt, "decodes": 2,
        "stages": [{"work_s": end - start, "reported_s": end} for start, end in stages],
    })  # fmt: skip


# Three micro-batches through two stages (seconds): the first carries a prompt chunk, the
# others decodes alone; one request is in the system from 0 to 8.
STEPS = [
    step_line(0.0, 3.4, [(0.0, 2.0), (2.0, 3.0)], prompt=60),
    step_line(0.0, 5.5, [(2.0, 3.0), (3.5, 5.5)], prompt=0),
    step_line(3.4, 6.5, [(3.6, 4.6), (5.5, 6.5)], prompt=0),
]
SPANS = [(OPENED_AT_S, OPENED_AT_S + 8.0)]


def test_each_stage_s_idle_time_is_split_by_what_the_pipeline_held(tmp_path: Path) -> None:
    log = tmp_path / STEP_LOG
    log.write_text("\n".join(STEPS) + "\n")
    stage0, stage1 = idle_causes(read_step_log(log), SPANS)
    # stage 0 idles 3-3.6 and 4.6-8: both stages idle with two in flight until 3.5 (hand-off),
    # then stage 1 on the second micro-batch's decodes until 5.5, then the third alone in
    # flight until 6.5, then nothing in flight
    expected0 = {"none": 1.5, "one": 1.0, "waiting, decodes": 1.0, "waiting, prompt": 0.0,
                 "hand-off": 0.5}  # fmt: skip
    # stage 1 waits 0-2 for stage 0's prompt chunk, idles 3-3.5 with stage 0, and after 6.5
    expected1 = {"none": 1.5, "one": 0.0, "waiting, decodes": 0.0, "waiting, prompt": 2.0,
                 "hand-off": 0.5}  # fmt: skip
    for measured, expected in ((stage0, expected0), (stage1, expected1)):
        assert list(measured) == list(CAUSES)
        # to a grid cell (0.1 ms) of 8 s
        assert measured == pytest.approx({c: s / 8.0 for c, s in expected.items()}, abs=2e-5)


def test_the_table_has_a_row_a_stage_for_every_run_and_a_missing_log_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "stages" / "sarathi-pp2").mkdir(parents=True)
    (tmp_path / "stages" / "sarathi-pp2" / STEP_LOG).write_text("\n".join(STEPS) + "\n")
    (tmp_path / "raw").mkdir()
    run = {"start_times": [OPENED_AT_S], "latencies": [8.0]}
    (tmp_path / "raw" / "sarathi-pp2_random-512-128_2qps.json").write_text(json.dumps(run))
    (tmp_path / "raw" / "sarathi-pp2_random-512-128_2qps.stages.json").write_text("{}")
    table = causes_table(tmp_path, "sarathi-pp2").splitlines()
    assert len(table) == 2 + 2  # header, rule, two stages
    assert table[2].startswith("| random-512-128_2qps | 0 | 50.0% |")  # idle 4 s of 8
    assert table[3].startswith("| random-512-128_2qps | 1 | 50.0% |")
    assert "| 0.0% | 0.0% | 25.0% |" in table[3]  # 2 s of 8 waiting for the prompt chunk
    assert main([str(tmp_path)]) == 0 and "random-512-128_2qps | 1 |" in capsys.readouterr().out
    # the driver's report: a table for each of ours' pipelines there, none for vLLM's
    (tmp_path / "stages" / "vllm-pp2").mkdir()
    assert all_causes_tables(tmp_path) == "sarathi-pp2:\n\n" + "\n".join(table)
    assert all_causes_tables(tmp_path / "elsewhere") == ""
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--system", "sarathi-pp3"])
    assert "no step log" in capsys.readouterr().err
