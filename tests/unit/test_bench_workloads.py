"""Workload generation: traces, the paper-matched synthetic, arrivals, filters and bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sarathictl.bench.workloads import (
    TRACE_ALIASES,
    TRACE_FILES,
    TRACES_DIR,
    WorkloadSpec,
    known_workloads,
    make_requests,
    read_trace,
    trace_path,
    unit_rate_requests,
)


def test_paper_sharegpt_synthetic_matches_table_2() -> None:
    spec = WorkloadSpec(source="sharegpt-paper", num_requests=4000, seed=3)
    rows = unit_rate_requests(spec)
    prompts = np.array([p for _, p, _ in rows])
    outputs = np.array([o for _, _, o in rows])
    assert max(p + o for _, p, o in rows) <= 8192
    # The 8192-token filter trims the upper tail, so quantiles sit a little below Table 2's.
    assert np.median(prompts) == pytest.approx(1730, rel=0.12)
    assert np.percentile(prompts, 90) == pytest.approx(5696, rel=0.2)
    assert np.median(outputs) == pytest.approx(415, rel=0.1)


def test_shared_arxiv_trace_and_length_filter() -> None:
    rows = unit_rate_requests(WorkloadSpec(source="arxiv", num_requests=500, max_total_tokens=3000))
    assert len(rows) == 500
    assert all(p + o <= 3000 for _, p, o in rows)


def test_same_seed_same_requests_and_rates_only_scale_arrivals() -> None:
    spec = WorkloadSpec(source="arxiv", num_requests=2000, seed=11)
    slow, fast = make_requests(spec, qps=1.0), make_requests(spec, qps=4.0)
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in slow] == [
        (r.num_prompt_tokens, r.num_output_tokens) for r in fast
    ]
    assert fast[-1].arrival_s == pytest.approx(slow[-1].arrival_s / 4)
    assert slow[-1].arrival_s / 2000 == pytest.approx(1.0, rel=0.1)  # Poisson at 1 request/s
    assert make_requests(spec, 1.0) == slow
    assert make_requests(WorkloadSpec(source="arxiv", num_requests=2000, seed=12), 1.0) != slow


def test_gamma_arrivals_are_burstier_than_poisson() -> None:
    def gap_cv2(arrival: str) -> float:
        spec = WorkloadSpec(source="fixed", num_requests=5000, arrival=arrival, burstiness=4.0)
        gaps = np.diff([t for t, _, _ in unit_rate_requests(spec)])
        return float(np.var(gaps) / np.mean(gaps) ** 2)

    assert gap_cv2("poisson") == pytest.approx(1.0, rel=0.15)
    assert gap_cv2("gamma") == pytest.approx(4.0, rel=0.25)


def test_synthetic_distributions_respect_their_bounds() -> None:
    for source in ("zipf", "uniform"):
        spec = WorkloadSpec(source=source, num_requests=300, prompt_tokens=900, output_tokens=50)
        rows = unit_rate_requests(spec)
        assert all(1 <= p <= 900 and 1 <= o <= 50 for _, p, o in rows)
    fixed = unit_rate_requests(WorkloadSpec(source="fixed", num_requests=3, prompt_tokens=7))
    assert [(p, o) for _, p, o in fixed] == [(7, 128)] * 3


def test_trace_with_missing_column_or_negative_length_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("num_prefill_tokens,num_decode_tokens\n100,10\n-4,10\n")
    with pytest.raises(ValueError, match=r"bad\.csv: line 3: lengths must be >= 1"):
        unit_rate_requests(WorkloadSpec(source=str(bad), num_requests=1))
    bad.write_text("num_prefill_tokens\n100\n")
    with pytest.raises(ValueError, match=r"line 1: missing column.*num_decode_tokens"):
        unit_rate_requests(WorkloadSpec(source=str(bad), num_requests=1))


def test_unknown_workload_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        unit_rate_requests(WorkloadSpec(source="no-such-trace"))
    message = str(err.value)
    assert "'no-such-trace'" in message
    assert "known names: arxiv, splitwise, sharegpt-paper" in message


@pytest.mark.parametrize("name", ["arxiv", "splitwise", "arxiv_summarization", "conv"])
def test_every_known_trace_loads_from_the_package(name: str) -> None:
    """The traces ship inside sarathictl: a user's clone or install needs nothing beside it."""
    path = trace_path(name)
    assert path.is_relative_to(TRACES_DIR)
    assert len(read_trace(path)) > 10_000
    assert name in known_workloads() or TRACE_ALIASES[name] in known_workloads()


def test_traces_ship_with_their_licenses() -> None:
    readme = (TRACES_DIR / "README.md").read_text()
    for csv_name in TRACE_FILES.values():
        assert csv_name in readme
    licenses = sorted(p.name for p in TRACES_DIR.glob("LICENSE-*"))
    assert licenses == ["LICENSE-CC-BY-4.0-azure", "LICENSE-MIT-vidur"]
