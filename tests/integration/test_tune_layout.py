"""`sarathictl tune-layout` on a tiny random model: each layout `up --local` can run is started,
measured and stopped, in turns over the rounds; the winner is kept for this machine, and `up`
then runs it and says why."""

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
                   "--output-tokens", "4", "--rounds", "2", "--json"),
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    doc = json.loads(tuned.stdout)
    layout = doc["layout"]
    assert doc["machine"]["dtype"] == "auto"
    names = [f"PP={f['pp']} {f['dtype']}" for f in layout["figures"]]
    assert [f["pp"] for f in layout["figures"]][:2] == [1, 2]
    for f in layout["figures"]:
        assert f["burst_requests_per_s"] > 0 and f["lone_ttft_ms"] > 0 and f["lone_tpot_ms"] > 0
    # the layouts took turns: forwards in round 1, backwards in round 2
    started = [line for line in tuned.stderr.splitlines() if "starting:" in line]
    assert [line.split(",")[0].lstrip("[") for line in started] == names + names[::-1]
    for name in names:
        for round_number in (1, 2):
            assert f"[{name}, round {round_number} of 2] alone: TTFT" in tuned.stderr
            assert f"[{name}, round {round_number} of 2] burst of 2:" in tuned.stderr
    kept = read_measured(layout_file, machine_key(str(model_dir), "auto"))
    assert kept is not None and (kept.pp, kept.dtype) == (layout["pp"], layout["dtype"])

    up = subprocess.Popen(
        sarathictl("up", "--local", "--port", "0", *small), stderr=subprocess.PIPE, text=True
    )
    assert up.stderr is not None
    output = LineReader(up.stderr)
    try:
        shown = output.until(lambda line: line.startswith("layout: "), 120)
        assert shown.startswith(f"layout: PP={layout['pp']} x TP=1"), shown
        assert f"  {layout['dtype']}: " in output.until(
            lambda line: "(--dtype to choose)" in line, 10
        )
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


def test_tune_layout_weighs_each_dtype_auto_may_run_and_up_runs_the_winner(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """As on a CPU with native bf16, where auto measures bf16 beside float32 (forced here, on
    any CPU: bf16 runs everywhere, if slowly): four layouts, and `up --dtype auto` then runs the
    winner's dtype."""
    from sarathictl import cli, layout_choice
    from sarathictl.commands import tune_layout, up

    monkeypatch.setattr(tune_layout, "auto_dtypes", lambda: ("bfloat16", "float32"))
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")
    layout_file = tmp_path_factory.mktemp("cache") / "layouts.json"
    small = ["--model", str(model_dir), "--kv-cache-mb", "16", "--layout-file", str(layout_file)]
    assert cli.main(["tune-layout", *small, "--requests", "2", "--prompt-tokens", "24",
                     "--output-tokens", "4", "--rounds", "1"]) == 0  # fmt: skip
    shown = capsys.readouterr()
    for name in ("PP=1 bfloat16", "PP=2 bfloat16", "PP=1 float32", "PP=2 float32"):
        assert f"| {name} |" in shown.out or f"| **{name}** |" in shown.out
        assert f"[{name}, round 1 of 1] burst of 2:" in shown.err
    kept = read_measured(layout_file, machine_key(str(model_dir), "auto"))
    assert kept is not None and len(kept.figures) == 4
    # The rule would run the dtype that lost; the measurement wins.
    lost = "float32" if kept.dtype == "bfloat16" else "bfloat16"
    monkeypatch.setattr(layout_choice, "default_dtype", lambda _device: lost)
    args = cli.build_parser().parse_args(["up", "--local", *small])
    config = up.cluster_config(args, port=0)
    assert (config.pp, config.dtype) == (kept.pp, kept.dtype)
