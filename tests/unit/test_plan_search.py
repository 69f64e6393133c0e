"""`sarathictl plan`'s search: the layouts a cluster allows, the budget bound, the ranking (a
small space with a known winner), and the Helm values of the winner."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import yaml  # type: ignore[import-untyped]
from sarathictl.bench.workloads import WorkloadSpec
from sarathictl.plan.evaluate import Candidate, Evaluation, evaluate
from sarathictl.plan.helm_values import deployable_winner, values_yaml
from sarathictl.plan.rank import rank
from sarathictl.plan.search import candidates_for, run_all
from sarathictl.plan.slo import resolve_slo_s
from sarathictl.plan.space import ClusterSpec, Layout, candidate_shapes, feasible_layouts

from controller.simulator import get_model

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "sarathi-cluster"


def falcon_on(num_gpus: int) -> ClusterSpec:
    return ClusterSpec(get_model("falcon-180b"), "a100", num_gpus, 4, "eth-100g", "nvlink")


def test_falcon_on_16_a100s_allows_the_layouts_that_hold_it() -> None:
    layouts, rejected = feasible_layouts(falcon_on(16), 512, 4096)
    assert sorted(lay.label for lay in layouts) == [
        "TP2-PP4",
        "TP4-PP2",
        "TP4-PP4",
        "TP8 (2 nodes)-PP1",
        "TP8 (2 nodes)-PP2",
    ]
    reasons = dict((lay.label, why) for lay, why in rejected)
    assert "not divisible into pp=3" in reasons["TP4-PP3"]
    assert "cannot hold falcon-180b" in reasons["TP4-PP1"]
    assert "232 attention heads, not divisible by tp=16" in reasons["TP16 (4 nodes)-PP1"]


def test_replicas_share_nodes_when_tp_is_below_a_node() -> None:
    cluster = ClusterSpec(get_model("mistral-7b"), "a100", 8, 4)
    assert Layout(1, 1).replicas_on(cluster) == 8
    assert Layout(2, 2).replicas_on(cluster) == 2  # two nodes, two stages of 2 GPUs per node
    assert Layout(4, 2).replicas_on(cluster) == 1
    assert Layout(8, 1, 2).replicas_on(cluster) == 1
    assert Layout(1, 3).replicas_on(cluster) == 0  # three stages need three nodes
    assert Layout(1, 3) not in candidate_shapes(cluster)
    assert not Layout(8, 1, 2).helm_deployable


def test_cluster_spec_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match=r"num_gpus \(10\) must be a multiple of gpus_per_node"):
        ClusterSpec(get_model("mistral-7b"), "a100", 10, 4)
    with pytest.raises(ValueError, match="gpus_per_node must be >= 1"):
        ClusterSpec(get_model("mistral-7b"), "a100", 4, 0)


def base_candidate(layout: Layout, slo_s: float = 1.0, **kw: object) -> Candidate:
    workload = WorkloadSpec(source="arxiv", num_requests=96)
    return Candidate(
        "falcon-180b", "a100", "eth-100g", "nvlink", layout, 512, workload, slo_s, 0.2, **kw
    )  # type: ignore[arg-type]


def test_budgets_whose_full_micro_batch_misses_the_slo_are_skipped() -> None:
    cluster = falcon_on(8)
    layouts = [Layout(4, 2), Layout(8, 1, 2)]
    chosen, skipped = candidates_for(
        base_candidate(layouts[0]), cluster, layouts, (512, 2048), 4096
    )
    assert {(c.layout.label, c.budget_tokens) for c in chosen} == {
        ("TP4-PP2", 512),
        ("TP4-PP2", 2048),
        ("TP8 (2 nodes)-PP1", 512),
    }
    assert [(s.layout.label, s.budget_tokens) for s in skipped] == [("TP8 (2 nodes)-PP1", 2048)]
    assert "over the 1 s SLO" in skipped[0].reason


def fake_evaluation(candidate: Candidate, capacity_qps: float) -> Evaluation:
    return Evaluation(candidate, capacity_qps, capacity_qps, None, 1000, 1, 0.0)


def test_ranking_by_cluster_capacity_and_by_gpus_for_a_target() -> None:
    cluster = ClusterSpec(get_model("mistral-7b"), "a100", 4, 4)
    known = {Layout(1, 1): 1.0, Layout(2, 1): 2.5, Layout(4, 1): 3.5}  # per replica
    candidates = [replace(base_candidate(lay), model="mistral-7b") for lay in known]

    def evaluator(c: Candidate) -> Evaluation:
        return fake_evaluation(c, known[c.layout])

    rows = rank(run_all(candidates, 1, evaluator=evaluator), cluster, 0.0)
    # Four TP1 replicas serve 4.0, two TP2 ones 5.0, one TP4 3.5.
    assert [(r.layout, r.cluster_capacity_qps) for r in rows] == [
        ("TP2-PP1", 5.0),
        ("TP1-PP1", 4.0),
        ("TP4-PP1", 3.5),
    ]
    target = [replace(c, target_qps=3.0) for c in candidates]
    rows = rank(run_all(target, 1, evaluator=evaluator), cluster, 3.0)
    # GPUs needed for 3 req/s: TP1 3 x 1, TP2 2 x 2, TP4 1 x 4: TP1 wins
    assert [(r.layout, r.replicas_needed, r.gpus_needed) for r in rows] == [
        ("TP1-PP1", 3, 3),
        ("TP2-PP1", 2, 4),
        ("TP4-PP1", 1, 4),
    ]
    assert all(r.fits_target for r in rows)
    too_much = rank(
        run_all([replace(c, target_qps=100.0) for c in candidates], 1, evaluator=evaluator),
        cluster,
        100.0,
    )
    assert not any(r.fits_target for r in too_much)


def test_tp4_pp2_beats_tp8_across_nodes_for_falcon() -> None:
    """The paper's finding on a tiny search (real simulations): TP8's all-reduces cross
    100 GbE, TP4-PP2 sends one activation per micro-batch."""
    cluster = falcon_on(8)
    candidates = [base_candidate(Layout(4, 2)), base_candidate(Layout(8, 1, 2))]
    rows = rank(run_all(candidates, 1, evaluator=evaluate), cluster, 0.0)
    assert [r.layout for r in rows] == ["TP4-PP2", "TP8 (2 nodes)-PP1"]
    assert rows[0].cluster_capacity_qps > 2 * rows[1].cluster_capacity_qps
    assert 0 < rows[0].kv_headroom < 1 and 0 <= rows[0].bubble_fraction < 0.5
    assert not math.isnan(rows[0].tbt_p99_s) and rows[0].tbt_p99_s <= 1.0


def test_strict_slo_is_the_paper_s_for_its_models_and_5x_a_decode_step_otherwise() -> None:
    layouts, _ = feasible_layouts(falcon_on(16), 512, 4096)
    assert resolve_slo_s("strict", falcon_on(16), layouts, 3000, 4096)[0] == 1.0
    custom = ClusterSpec(replace(get_model("mistral-7b"), name="my-7b"), "a100", 8, 8)
    layouts, _ = feasible_layouts(custom, 512, 4096)
    strict_s, why = resolve_slo_s("strict", custom, layouts, 2000, 4096)
    relaxed_s, _ = resolve_slo_s("relaxed", custom, layouts, 2000, 4096)
    assert relaxed_s == pytest.approx(5 * strict_s)
    assert "5x the decode step of a batch of 32 on TP1-PP1" in why
    assert resolve_slo_s(0.25, custom, layouts, 2000, 4096) == (0.25, "given")


def test_winner_values_validate_against_the_chart(tmp_path: Path) -> None:
    cluster = falcon_on(16)
    candidates = [base_candidate(Layout(8, 1, 2)), base_candidate(Layout(4, 2))]
    caps = {"TP8 (2 nodes)-PP1": 5.0, "TP4-PP2": 1.0}
    rows = rank(
        run_all(candidates, 1, evaluator=lambda c: fake_evaluation(c, caps[c.layout.label])),
        cluster,
        0.0,
    )
    assert rows[0].layout == "TP8 (2 nodes)-PP1"  # best, but the chart cannot run it
    winner = deployable_winner(rows)
    assert winner is not None and winner.layout == "TP4-PP2"
    values = yaml.safe_load(values_yaml(winner, "falcon-180b", "test"))
    assert values["tp"] == 4 and values["pp"] == 2 and values["pipelines"] == 2
    assert values["scheduler"]["budgetTokens"] == 512
    assert values["scheduler"]["prefixCaching"] is True
    off = yaml.safe_load(values_yaml(winner, "falcon-180b", "test", prefix_caching=False))
    assert off["scheduler"]["prefixCaching"] is False
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    merged = {**defaults, **{k: v for k, v in values.items() if not isinstance(v, dict)}}
    for key, sub in values.items():
        if isinstance(sub, dict):
            assert set(sub) <= set(defaults[key]), f"{key}: keys not in values.yaml"
            merged[key] = {**defaults[key], **sub}
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(merged, schema)
