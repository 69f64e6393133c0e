"""`sarathictl plan` end to end: the real CLI in a subprocess on a tiny search space (Falcon-180B
on 8 A100s, two nodes of 4: TP4-PP2 against TP8 across the nodes, one budget, few requests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml  # type: ignore[import-untyped]

PLAN = [
    sys.executable, "-m", "sarathictl.cli", "plan",
    "--model", "falcon-180b", "--gpu", "a100", "--num-gpus", "8", "--gpus-per-node", "4",
    "--link", "eth-100g", "--trace", "arxiv", "--num-requests", "96", "--tbt-slo", "strict",
    "--budgets", "512", "--granularity", "0.2", "--jobs", "2",
]  # fmt: skip


def run_plan(*extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PLAN, *extra], capture_output=True, text=True, timeout=300, check=False)


def test_plan_ranks_layouts_and_writes_the_winner_s_values(tmp_path: Path) -> None:
    values_path = tmp_path / "values.yaml"
    done = run_plan("--json", "--values", str(values_path), "--target-qps", "1.5")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    rows = plan["rows"]
    assert [r["layout"] for r in rows] == ["TP4-PP2", "TP8 (2 nodes)-PP1"]
    best = rows[0]
    assert best["capacity_per_replica_qps"] > 0 and best["replicas_needed"] >= 1
    assert best["gpus_needed"] == best["replicas_needed"] * 8
    assert plan["tbt_slo_s"] == 1.0 and "Table 3" in plan["tbt_slo_rule"]
    assert "[plan 2/2]" in done.stderr and "done in" in done.stderr  # progress on stderr
    values = yaml.safe_load(values_path.read_text())
    assert (values["tp"], values["pp"]) == (best["tp"], best["pp"])
    assert values["pipelines"] == best["replicas_needed"]


def test_plan_table_and_a_clear_error() -> None:
    done = run_plan("--top", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("falcon-180b on 8 a100 (4 per node, eth-100g), arxiv")
    assert lines[2].split()[:2] == ["1", "TP4-PP2"]
    assert "1 more (--top 0 shows all)" in done.stdout
    assert "TP4-PP1: tp=4 pp=1 cannot hold falcon-180b" in done.stdout
    two_gpus = [*PLAN]
    two_gpus[two_gpus.index("--num-gpus") + 1] = "2"  # two GPUs in nodes of 4
    bad = subprocess.run(two_gpus, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode != 0
    assert "num_gpus (2) must be a multiple of gpus_per_node (4)" in bad.stderr
