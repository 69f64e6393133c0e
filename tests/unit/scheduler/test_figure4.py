"""The paper's Figure 4: A and B are decoding when C and D arrive. What each policy does."""

from __future__ import annotations

from controller.scheduler import MicroBatch, Scheduler
from tests.unit.scheduler.factories import FakePipeline, add_request, chunk_map, create_scheduler

A, B, C, D = 1, 2, 3, 4
PROMPT_C, PROMPT_D = 100, 60


def start_with_a_and_b_decoding(policy: str, budget_tokens: int = 64) -> FakePipeline:
    sched: Scheduler = create_scheduler(policy=policy, budget_tokens=budget_tokens)
    add_request(sched, A, prompt_len=8, max_tokens=12)
    add_request(sched, B, prompt_len=8, max_tokens=12)
    pipe = FakePipeline(sched)
    pipe.fill()
    pipe.complete_oldest()  # A's and B's prompts done: both now decode
    assert sched.get(A) is not None and sched.get(A).is_decoding  # type: ignore[union-attr]
    pipe.fill()
    pipe.complete_oldest()  # one decode-only iteration, as in the figure
    add_request(sched, C, prompt_len=PROMPT_C, max_tokens=4, now=pipe.now)
    add_request(sched, D, prompt_len=PROMPT_D, max_tokens=4, now=pipe.now)
    return pipe


def next_batch(pipe: FakePipeline) -> MicroBatch:
    (batch,) = pipe.fill()
    pipe.complete_oldest()
    return batch


def test_vllm_stalls_decodes_for_whole_prefills() -> None:
    pipe = start_with_a_and_b_decoding("vllm", budget_tokens=256)
    batch = chunk_map(next_batch(pipe))
    assert batch == {C: (0, PROMPT_C), D: (0, PROMPT_D)}  # A and B are stalled
    batch = chunk_map(next_batch(pipe))
    assert set(batch) == {A, B, C, D}  # decodes resume only after both prefills


def test_orca_runs_whole_prefills_beside_decodes() -> None:
    pipe = start_with_a_and_b_decoding("orca", budget_tokens=256)
    batch = chunk_map(next_batch(pipe))
    assert batch[C] == (0, PROMPT_C) and batch[D] == (0, PROMPT_D)
    assert batch[A][1] == 1 and batch[B][1] == 1


def test_request_level_admits_only_after_running_requests_finish() -> None:
    pipe = start_with_a_and_b_decoding("request_level", budget_tokens=256)
    seen_c = []
    while pipe.sched.get(A) is not None or pipe.sched.get(B) is not None:
        batch = chunk_map(next_batch(pipe))
        seen_c.append(C in batch)
        assert D not in batch
    assert not any(seen_c)
    batch = chunk_map(next_batch(pipe))
    assert batch == {C: (0, PROMPT_C), D: (0, PROMPT_D)}


def test_sarathi_splits_c_into_chunks_riding_with_decodes() -> None:
    budget = 64
    pipe = start_with_a_and_b_decoding("sarathi", budget_tokens=budget)
    first = chunk_map(next_batch(pipe))
    second = chunk_map(next_batch(pipe))
    for batch in (first, second):
        assert batch[A][1] == 1 and batch[B][1] == 1  # decodes never stall
        assert sum(n for _, n in batch.values()) <= budget
    # C is split: its first chunk fills the budget left after the two decodes.
    assert first[C] == (0, budget - 2)
    assert second[C] == (budget - 2, PROMPT_C - (budget - 2))
    # D starts in the leftover budget of the second iteration, after C's last chunk.
    assert second[D] == (0, budget - 2 - second[C][1])


def test_chunked_only_chunks_prompts_but_stalls_decodes() -> None:
    budget = 64
    pipe = start_with_a_and_b_decoding("chunked_only", budget_tokens=budget)
    first = chunk_map(next_batch(pipe))
    assert A not in first and B not in first
    assert first[C] == (0, budget)


def test_sarathi_tbt_never_exceeds_one_iteration_while_prompts_arrive() -> None:
    # A user-visible consequence: A gets a token in every iteration while C and D prefill.
    pipe = start_with_a_and_b_decoding("sarathi")
    for _ in range(4):
        assert A in chunk_map(next_batch(pipe))
