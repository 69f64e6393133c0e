"""`sarathictl bench prefix-routing` end to end: the real CLI in a subprocess, two local
pipelines of a tiny model, chats routed by each policy, the controllers' own prefix-cache
counters read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.cluster_factories import make_tiny_served_model


def test_two_pipelines_each_policy_counted_from_the_controllers(tmp_path: Path) -> None:
    model_dir = make_tiny_served_model(tmp_path / "tiny-llama")
    out = tmp_path / "routing.json"
    command = [
        sys.executable, "-m", "sarathictl.cli", "bench", "prefix-routing",
        "--model", str(model_dir), "--dtype", "float32", "--threads", "1",
        "--policies", "single", "round-robin", "epp",
        # One conversation at a time: each pick sees both pipelines idle, so where a turn goes
        # depends on the policy alone.
        "--sessions", "1", "--turns", "4", "--think-s", "0",
        "--system-words", "30", "--question-words", "8", "--answer-tokens", "4",
        "--json-output", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["single", "round-robin", "epp"]
    for r in results.values():
        assert r["errors"] == 0 and r["requests"] == 4 and r["later_turns"] == 3
        assert r["requests_admitted"] == 4  # the counters of this policy's run only
        assert 0 < r["ttft_median_s"] <= r["ttft_p90_s"] < 60  # streamed: a first token seen
    single, rr, epp = results["single"], results["round-robin"], results["epp"]
    assert single["requests_per_pipeline"] == [4, 0]
    # On one pipeline every later turn finds its history, most of its prompt.
    assert single["requests_hit"] == 3
    assert single["cached_tokens"] > 0.5 * single["prompt_tokens"]
    # Round robin sends every turn away from its history; the picker sends each back to it
    # and so computes less.
    assert rr["requests_per_pipeline"] == [2, 2] and rr["later_turns_same_pipeline"] == 0
    assert epp["later_turns_same_pipeline"] == 3
    epp_computed = epp["prompt_tokens"] - epp["cached_tokens"]
    assert epp_computed < rr["prompt_tokens"] - rr["cached_tokens"]
    assert "epp" in done.stderr + done.stdout
