"""The plan's search: every feasible layout crossed with every token budget, each candidate's
capacity simulated in a process pool (local worker processes; nothing leaves the machine).

A budget is skipped before simulating when one full micro-batch of it alone takes longer than
the SLO to come round again (PP stage times): every decode riding with a full prompt chunk
would then miss the SLO."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace

from controller.simulator import AnalyticCostModel
from sarathictl.plan.evaluate import Candidate, Evaluation, evaluate
from sarathictl.plan.space import ClusterSpec, Layout, deployment_of

Evaluator = Callable[[Candidate], Evaluation]


@dataclass(frozen=True)
class Skipped:
    layout: Layout
    budget_tokens: int
    """0: the whole layout."""
    reason: str


def round_trip_s(cluster: ClusterSpec, layout: Layout, budget: int, min_kv_tokens: int) -> float:
    """A decode's gap when every micro-batch is a full prompt chunk: PP stage times (each
    stage holds one micro-batch while the others hold the rest) plus the transfers."""
    model = AnalyticCostModel(deployment_of(cluster, layout, budget, min_kv_tokens))
    return layout.pp * model.stage_time_s(budget, 0.0) + layout.pp * model.transfer_s(budget)


def candidates_for(
    base: Candidate,
    cluster: ClusterSpec,
    layouts: list[Layout],
    budgets: tuple[int, ...],
    min_kv_tokens: int,
) -> tuple[list[Candidate], list[Skipped]]:
    """base with each layout and budget, and those skipped by the round-trip bound."""
    chosen: list[Candidate] = []
    skipped: list[Skipped] = []
    for layout in layouts:
        for budget in budgets:
            try:
                trip_s = round_trip_s(cluster, layout, budget, min_kv_tokens)
            except ValueError as err:  # the activations of a larger budget leave no KV room
                skipped.append(Skipped(layout, budget, str(err)))
                continue
            if trip_s > base.tbt_slo_s:
                reason = (
                    f"a full {budget}-token micro-batch comes round in {trip_s:.3g} s, over "
                    f"the {base.tbt_slo_s:.3g} s SLO"
                )
                skipped.append(Skipped(layout, budget, reason))
            else:
                chosen.append(replace(base, layout=layout, budget_tokens=budget))
    return chosen, skipped


def run_all(
    candidates: list[Candidate],
    jobs: int,
    on_done: Callable[[Evaluation, int, int], None] | None = None,
    evaluator: Evaluator = evaluate,
) -> list[Evaluation]:
    """Evaluates every candidate (jobs > 1: in worker processes); on_done(result, done, total)
    as each ends."""
    results: list[Evaluation] = []
    total = len(candidates)
    if jobs <= 1 or total <= 1:
        for candidate in candidates:
            results.append(evaluator(candidate))
            if on_done is not None:
                on_done(results[-1], len(results), total)
        return results
    pool: Executor
    with ProcessPoolExecutor(max_workers=min(jobs, total)) as pool:
        futures: list[Future[Evaluation]] = [pool.submit(evaluator, c) for c in candidates]
        for future in as_completed(futures):
            results.append(future.result())
            if on_done is not None:
                on_done(results[-1], len(results), total)
    return results
