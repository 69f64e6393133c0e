"""The controller's opt-in memory trace (`--memory-trace-dir`): off it starts nothing; on, its
reports name the line whose allocations grew, with the process's RSS and malloc view."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from controller.__main__ import build_parser, memory_trace_config
from controller.memory_trace import MemoryTraceConfig, memory_trace
from controller.scheduler import ConfigError

kept: list[list[float]] = []


def grow(n: int) -> int:
    for i in range(n):
        kept.append([float(i), float(-i)])  # the line the report must name
    return grow.__code__.co_firstlineno + 2


def test_off_by_default_traces_nothing(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--model", str(tmp_path)])
    config = memory_trace_config(args)
    assert not config.enabled
    with memory_trace(config) as tracer:
        assert tracer is None
        assert not tracemalloc.is_tracing()


def test_reports_name_the_line_that_grew(tmp_path: Path) -> None:
    out = tmp_path / "trace"
    args = build_parser().parse_args(
        [
            "--model",
            str(tmp_path),
            "--memory-trace-dir",
            str(out),
            "--memory-trace-interval",
            "3600",
        ]
    )
    kept.clear()
    with memory_trace(memory_trace_config(args)) as tracer:
        assert tracer is not None and tracemalloc.is_tracing()
        tracer.report()  # the baseline
        line = grow(20_000)
        report = tracer.report()
    assert not tracemalloc.is_tracing()  # stopped at exit, after a last report
    lines = [json.loads(text) for text in (out / "memory.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    top = lines[1]["top_growth_since_first"][0]
    assert top["site"] == f"{__file__}:{line}"
    # 20,000 lists: each a list object and an item array (56 + 16 bytes), and two floats unless
    # they came from the float free list (tracemalloc sees only fresh allocations).
    assert top["blocks"] >= 2 * 20_000 and top["kib"] > 20_000 * 72 / 1024
    assert lines[1]["rss_mib"] > 0 and lines[1]["traced_mib"] > 1.5
    text = report.read_text()
    assert f"test_memory_trace.py:{line}" in text.split("grew most since the first report")[1]
    assert "list" in text.split("object types whose count grew most")[1]
    kept.clear()


def test_frames_0_reports_rss_and_malloc_without_tracing(tmp_path: Path) -> None:
    out = tmp_path / "trace"
    args = build_parser().parse_args(
        ["--model", str(tmp_path), "--memory-trace-dir", str(out), "--memory-trace-frames", "0"]
    )
    with memory_trace(memory_trace_config(args)) as tracer:
        assert tracer is not None and not tracemalloc.is_tracing()
        tracer.report()
    line = json.loads((out / "memory.jsonl").read_text().splitlines()[0])
    assert line["rss_mib"] > 0 and "traced_mib" not in line
    assert line["malloc_in_use_mib"] > 0  # glibc's view (this machine runs glibc)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"interval_s": 0.5}, "memory_trace_interval_s"),
        ({"frames": -1}, "memory_trace_frames"),
        ({"frames": 65}, "memory_trace_frames"),
        ({"top": 0}, "memory_trace_top"),
    ],
)
def test_config_refuses_values_out_of_range(fields: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        MemoryTraceConfig(out_dir="x", **fields)  # type: ignore[arg-type]
    assert err.value.field == field
