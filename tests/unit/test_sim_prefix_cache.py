"""The simulator prices the prefix cache by the workload's own sharing: a chat trace whose
requests share a system prompt computes it once, and a workload that shares nothing runs exactly
as without the cache (no false sharing among simulated prompts)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sarathictl.bench.sim_run import SimSetup, prepare
from sarathictl.bench.workloads import WorkloadSpec, make_requests
from sarathictl.cli import main

from controller.executor.simulated import sim_prompt

CHAT = WorkloadSpec(source="splitwise", num_requests=120, arrival="poisson")


def test_simulated_prompts_share_only_their_system_prompt() -> None:
    spec = replace(CHAT, num_requests=4, system_prompt_tokens=32, num_system_prompts=2)
    a, b, c, _ = make_requests(spec, qps=1.0)
    assert (a.prefix_id, b.prefix_id, c.prefix_id) == (0, 1, 0)
    pa, pb, pc = sim_prompt(0, a), sim_prompt(1, b), sim_prompt(2, c)
    assert pa[:32] == pc[:32] != pb[:32]
    assert len(pa) == a.num_prompt_tokens and pa[32] != pc[32]
    plain = make_requests(replace(spec, system_prompt_tokens=0), qps=1.0)
    assert a.num_prompt_tokens == plain[0].num_prompt_tokens + 32
    assert sim_prompt(0, plain[0])[0] != sim_prompt(1, plain[1])[0]


def _run(workload: WorkloadSpec, prefix_caching: bool, qps: float = 2.0):  # type: ignore[no-untyped-def]
    setup = SimSetup(
        model="mistral-7b", workload=workload, prefix_caching=prefix_caching, budget_tokens=512
    )
    return prepare(setup).run(qps)


def test_a_shared_system_prompt_is_computed_once_with_the_cache() -> None:
    chat = replace(CHAT, system_prompt_tokens=2000)
    cached, uncached = _run(chat, True), _run(chat, False)
    assert cached.ttft_p50_s < 0.7 * uncached.ttft_p50_s
    assert cached.num_requests == uncached.num_requests == 120


def test_without_sharing_the_cache_changes_nothing() -> None:
    assert _run(CHAT, True) == _run(CHAT, False)


@pytest.mark.parametrize("system_prompt_tokens", [0, 2000])
def test_capacity_command_takes_the_system_prompt_and_the_switch(
    system_prompt_tokens: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "capacity", "--model", "mistral-7b", "--policies", "sarathi"]
    argv += ["--tbt-slo", "0.1", "--trace", "splitwise", "--num-requests", "150", "--json"]
    argv += ["--system-prompt-tokens", str(system_prompt_tokens)]
    capacities = []
    for switch in ([], ["--no-prefix-caching"]):
        assert main(argv + switch) == 0
        (row,) = json.loads(capsys.readouterr().out)["results"]
        capacities.append(row["capacity_qps"])
    with_cache, without = capacities
    if system_prompt_tokens:
        assert with_cache > 1.2 * without
    else:
        assert with_cache == without
