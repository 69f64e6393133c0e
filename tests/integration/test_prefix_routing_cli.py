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
        "--sessions", "2", "--turns", "3", "--think-s", "0",
        "--system-words", "30", "--question-words", "8", "--answer-tokens", "4",
        "--json-output", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["single", "round-robin", "epp"]
    for r in results.values():
        assert r["errors"] == 0 and r["requests"] == 6
        assert r["requests_admitted"] == 6  # the counters of this policy's run only
    single, rr, epp = results["single"], results["round-robin"], results["epp"]
    assert single["requests_per_pipeline"] == [6, 0]
    assert rr["requests_per_pipeline"] == [3, 3]
    # On one pipeline every later turn finds its history: at least those 4 requests hit, and
    # they hit most of their prompt (system prompt and earlier turns).
    assert single["requests_hit"] >= 4
    assert single["cached_tokens"] > 0.5 * single["prompt_tokens"]
    # Idle pipelines: the picker sends each later turn back to where the conversation was.
    assert epp["later_turns_same_pipeline"] == epp["later_turns"] == 4
    assert "epp" in done.stderr + done.stdout
