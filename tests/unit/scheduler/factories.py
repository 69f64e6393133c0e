"""Small factories for scheduler tests, and a fake pipeline that runs micro-batches in order."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from controller.scheduler import (
    CacheConfig,
    MicroBatch,
    RequestParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
)
from controller.scheduler.scheduler import VECTOR_DECODES_FROM


def create_scheduler(
    policy: str = "sarathi",
    budget_tokens: int = 64,
    tile_tokens: int = 1,
    max_num_seqs: int = 16,
    max_model_len: int = 4096,
    pipeline_depth: int = 1,
    num_blocks: int = 1024,
    block_size: int = 16,
    watermark: float = 0.0,
    vector_decodes_from: int = VECTOR_DECODES_FROM,
    spread_decodes: bool = True,
    prefix_caching: bool = True,
    **overrides: object,
) -> Scheduler:
    """vector_decodes_from=1: every decode goes in the micro-batch's vector block; a huge value:
    every decode goes as a chunk of its own. spread_decodes=False: every ready decode goes into
    the next micro-batch, whatever PP (the scheduler before decodes were spread)."""
    config = SchedulerConfig(
        policy=policy,
        budget_tokens=budget_tokens,
        tile_tokens=tile_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        pipeline_depth=pipeline_depth,
        **overrides,  # type: ignore[arg-type]
    )
    return Scheduler(
        config,
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            watermark=watermark,
            prefix_caching=prefix_caching,
        ),
        vector_decodes_from,
        spread_decodes,
    )


def add_request(
    sched: Scheduler, seq_id: int, prompt_len: int, max_tokens: int, now: float = 0.0
) -> Sequence:
    """A request whose prompt tokens encode (seq_id, position), so mix-ups show in assertions."""
    prompt = [seq_id * 100_000 + i for i in range(prompt_len)]
    return sched.add_request(seq_id, prompt, RequestParams(max_tokens=max_tokens), now)


def token_for(seq_id: int, last_position: int) -> int:
    """The fake model's next token: a function of the sequence and the position it follows, so
    recomputation after a preemption yields the same token, as greedy sampling does."""
    return 7_000_000 + seq_id * 1000 + last_position


@dataclass
class FakePipeline:
    """Runs micro-batches in submission order, like stages do; each returns one token per
    yielding chunk. Records every batch it ran."""

    sched: Scheduler
    inflight: deque[MicroBatch] = field(default_factory=deque)
    history: list[MicroBatch] = field(default_factory=list)
    now: float = 0.0

    def fill(self) -> list[MicroBatch]:
        """Schedules until the scheduler returns None (pipeline full or nothing to run)."""
        issued = []
        while (batch := self.sched.schedule(self.now)) is not None:
            self.inflight.append(batch)
            self.history.append(batch)
            issued.append(batch)
        return issued

    def complete_oldest(self) -> list[Sequence]:
        self.now += 1.0
        batch = self.inflight.popleft()
        sampled = {
            c.seq_id: token_for(c.seq_id, c.context_len - 1) for c in batch.chunks if c.yields_token
        }
        return self.sched.on_result(batch.batch_id, sampled, self.now)

    def run_to_completion(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            self.fill()
            if not self.inflight:
                if self.sched.has_unfinished:
                    raise AssertionError("scheduler is stuck: work left but nothing scheduled")
                return
            self.complete_oldest()
            self.sched.check_invariants()
        raise AssertionError(f"not finished after {max_steps} steps")


def chunk_map(batch: MicroBatch) -> dict[int, tuple[int, int]]:
    """seq_id -> (first_position, num_tokens) for one micro-batch."""
    return {c.seq_id: (c.first_position, c.num_tokens) for c in batch.chunks}
