"""What a micro-batch's builder may read and change of the scheduler: its queues, its KV
accounting and the moves that keep them consistent.

BatchBuilder works on this protocol rather than on Scheduler, so the imports run one way:
scheduler -> policies -> batch_builder -> scheduler_state, and nothing imports back.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from controller.scheduler.block_manager import BlockManager
from controller.scheduler.config import SchedulerConfig
from controller.scheduler.decode_roster import DecodeRoster
from controller.scheduler.prefix_cache import PrefixCache
from controller.scheduler.quarantine import Quarantine
from controller.scheduler.sequence import Sequence


class SchedulerState(Protocol):
    config: SchedulerConfig
    block_manager: BlockManager
    prefix_cache: PrefixCache
    roster: DecodeRoster
    """Decoding sequences, as arrays for the vector path."""
    waiting: deque[Sequence]
    running: dict[int, Sequence]
    not_decoding: dict[int, Sequence]
    """Running sequences off the roster: prefilling, or waiting for their last chunk's token."""
    inflight_decodes: dict[int, int]
    inflight_prompt_tokens: dict[int, int]
    forks: dict[int, list[Sequence]]
    forking: list[Sequence]
    quarantine: Quarantine
    """Its suspect on trial is the one sequence admitted until the trial ends."""
    vector_decodes_from: int
    spread_decodes: bool
    spread_prompts: bool

    @property
    def num_inflight_batches(self) -> int: ...

    def admit(self, seq: Sequence) -> None: ...

    def join_roster(self, seq: Sequence) -> None: ...

    def grow_by_one_block(self, seq: Sequence) -> int | None: ...

    def start_from(
        self, seq: Sequence, source: list[int], num_cached: int, num_blocks: int
    ) -> None: ...
