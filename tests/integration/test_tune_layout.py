"""`sarathictl tune-layout` on a tiny random model: each layout `up --local` can run is started,
measured and stopped, the winner is kept for this machine, and `up` then runs it and says why."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from sarathictl.layout_file import machine_key, read_measured

from tests.integration.cluster_factories import make_tiny_served_model
from tests.integration.process_lines import LineReader

pytestmark = pytest.mark.integration


def sarathictl(*args: str) -> list[str]:
    return [sys.executable, "-m", "sarathictl.cli", *args]


def test_tune_layout_keeps_the_winner_and_up_runs_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")
    layout_file = tmp_path_factory.mktemp("cache") / "layouts.json"
    small = ["--model", str(model_dir), "--kv-cache-mb", "16", "--layout-file", str(layout_file)]
    tuned = subprocess.run(
        sarathictl("tune-layout", *small, "--requests", "2", "--prompt-tokens", "24",
                   "--output-tokens", "4", "--repeats", "1", "--json"),
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    doc = json.loads(tuned.stdout)
    layout = doc["layout"]
    assert [f["pp"] for f in layout["figures"]] == [1, 2]
    for f in layout["figures"]:
        assert f["burst_requests_per_s"] > 0 and f["lone_ttft_ms"] > 0 and f["lone_tpot_ms"] > 0
        assert f"[PP={f['pp']}] alone: TTFT" in tuned.stderr
        assert f"[PP={f['pp']}] burst 1 of 1:" in tuned.stderr
    kept = read_measured(layout_file, machine_key(str(model_dir), doc["machine"]["dtype"]))
    assert kept is not None and kept.pp == layout["pp"]

    up = subprocess.Popen(
        sarathictl("up", "--local", "--port", "0", *small), stderr=subprocess.PIPE, text=True
    )
    assert up.stderr is not None
    output = LineReader(up.stderr)
    try:
        shown = output.until(lambda line: line.startswith("layout: "), 120)
        assert shown.startswith(f"layout: PP={layout['pp']} x TP=1"), shown
        output.until(lambda line: line.startswith("serving on"), 120)
        assert "measured on this machine by `sarathictl tune-layout`" in output.text()
    finally:
        up.send_signal(signal.SIGINT)
        try:
            rest = output.rest(60)
        finally:
            if up.poll() is None:  # a failed test leaves nothing behind
                up.kill()
            up.wait(10)
    assert "stopped: no process left behind" in rest
