"""A virtual-time pipeline of P stages, driven by the real scheduler as the real engine drives
the ZeroMQ pipeline: schedule when stage 0 is free, apply results when they return.

Stages run micro-batches in submission order (FIFO) and a micro-batch moves to stage s+1 when
stage s finishes it and the activation transfer lands, so a micro-batch's whole path through the
pipeline is known the moment it is submitted. The scheduler keeps at most `pipeline_depth` of
them in flight; their sampled tokens come back when the last stage finishes.
"""

from __future__ import annotations

import heapq
import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from controller.scheduler import InvalidRequestError, MicroBatch, RequestParams, Scheduler
from controller.simulator.cost_model import StageCost

logger = logging.getLogger(__name__)


class CostModel(Protocol):
    num_stages: int

    def micro_batch_cost(self, batch: MicroBatch) -> StageCost: ...


class SimulatedPipeline:
    """The executor: `submit` a micro-batch when `stage0_free_at_s <= now`, collect it with
    `pop_completed` once `next_completion_s` has passed."""

    def __init__(self, cost_model: CostModel, record_intervals: bool = False) -> None:
        self.cost_model = cost_model
        self.num_stages = cost_model.num_stages
        self._stage_free_at_s = [0.0] * self.num_stages
        self.stage_busy_s = [0.0] * self.num_stages
        # Per stage, (start_s, end_s) of every micro-batch it ran, when record_intervals is set.
        self.stage_intervals: list[list[tuple[float, float]]] | None = (
            [[] for _ in range(self.num_stages)] if record_intervals else None
        )
        self._completions: list[tuple[float, int, MicroBatch]] = []
        self.num_batches = 0
        self.steady_window_s: tuple[float, float] | None = None
        """Where set, steady_busy_s counts each stage's busy time inside this window."""
        self.steady_busy_s = [0.0] * self.num_stages

    @property
    def stage0_free_at_s(self) -> float:
        return self._stage_free_at_s[0]

    @property
    def last_busy_end_s(self) -> float:
        return max(self._stage_free_at_s)

    @property
    def next_completion_s(self) -> float | None:
        return self._completions[0][0] if self._completions else None

    @property
    def num_inflight(self) -> int:
        return len(self._completions)

    def submit(self, batch: MicroBatch, now: float) -> float:
        """Runs batch through every stage in order; returns when its tokens are back."""
        cost = self.cost_model.micro_batch_cost(batch)
        free_at, busy, intervals = self._stage_free_at_s, self.stage_busy_s, self.stage_intervals
        ready_s = now
        last = self.num_stages - 1
        for stage, time_s in enumerate(cost.stage_times_s):
            start_s = free_at[stage] if free_at[stage] > ready_s else ready_s
            end_s = start_s + time_s
            free_at[stage] = end_s
            busy[stage] += time_s
            if self.steady_window_s is not None:
                lo, hi = self.steady_window_s
                overlap = min(end_s, hi) - max(start_s, lo)
                if overlap > 0:
                    self.steady_busy_s[stage] += overlap
            if intervals is not None:
                intervals[stage].append((start_s, end_s))
            ready_s = end_s + cost.transfer_s if stage < last else end_s + cost.return_s
        heapq.heappush(self._completions, (ready_s, batch.batch_id, batch))
        self.num_batches += 1
        return ready_s

    def pop_completed(self, now: float) -> list[tuple[float, MicroBatch]]:
        """Micro-batches whose tokens are back by now, in completion order."""
        done: list[tuple[float, MicroBatch]] = []
        completions = self._completions
        while completions and completions[0][0] <= now:
            done_s, _, batch = heapq.heappop(completions)
            done.append((done_s, batch))
        return done


def steady_window(arrivals_s: Sequence[float], share: float = 0.8) -> tuple[float, float]:
    """The middle `share` of a probe's arrivals (sorted): from the arrival at the (1 - share) / 2
    quantile to the one at (1 + share) / 2, leaving out the ramp-up and the drain."""
    if not arrivals_s:
        return (0.0, 0.0)
    last = len(arrivals_s) - 1
    edge = (1.0 - share) / 2
    return arrivals_s[round(edge * last)], arrivals_s[round((1.0 - edge) * last)]


class SimRequest(NamedTuple):
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    prefix_id: int = -1
    """Which shared prefix (a system prompt) the prompt starts with; -1: none."""
    num_prefix_tokens: int = 0
    """Tokens of that prefix, within num_prompt_tokens."""


def sim_prompt(seq_id: int, req: SimRequest) -> list[int]:
    """Token ids standing for a request's prompt: its shared prefix (the same ids in every
    request naming it) then ids of its own, so that the scheduler's prefix cache finds exactly
    the sharing the workload describes (no model reads them)."""
    shared = min(req.num_prefix_tokens, req.num_prompt_tokens) if req.prefix_id >= 0 else 0
    return [-1 - req.prefix_id] * shared + [seq_id] * (req.num_prompt_tokens - shared)


class RequestRecord(NamedTuple):
    arrival_s: float
    scheduled_s: float
    first_token_s: float
    finish_s: float
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class SimulationResult:
    requests: list[RequestRecord]
    tbt_gaps_s: array[float]
    """array('d'): every gap between two consecutive tokens of one request, seconds."""
    stage_busy_s: list[float]
    start_s: float
    end_s: float
    num_batches: int
    num_preemptions: int
    num_rejected: int = 0
    stopped_early: bool = False
    """Ended once more than half the requests were scheduled later than the delay limit."""
    stage_intervals: list[list[tuple[float, float]]] | None = field(default=None, repr=False)
    steady_window_s: tuple[float, float] = (0.0, 0.0)
    """The middle 80% of the arrivals (steady_window)."""
    steady_stage_busy_s: list[float] = field(default_factory=list)
    """Each stage's busy seconds inside steady_window_s."""


def run_simulation(
    scheduler: Scheduler,
    pipeline: SimulatedPipeline,
    requests: Sequence[SimRequest],
    stop_delay_s: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> SimulationResult:
    """Replays requests (sorted by arrival) through scheduler and pipeline in virtual time.

    stop_delay_s: stop as soon as more than half the requests are known to wait longer than this
    to be scheduled (the median scheduling delay then exceeds it whatever happens next)."""
    replay = _Replay(scheduler, pipeline, requests, stop_delay_s, progress)
    pipeline.steady_window_s = steady_window([r.arrival_s for r in requests])
    now = requests[0].arrival_s if requests else 0.0
    loops = 0
    stopped = False
    while replay.next_arrival < len(requests) or scheduler.has_unfinished:
        replay.apply_results(now)  # the engine applies what is back first
        replay.admit_arrivals(now)
        if pipeline.stage0_free_at_s <= now:  # stage 0 free: ask for the next micro-batch
            new_batch = scheduler.schedule(now)
            if new_batch is not None:
                pipeline.submit(new_batch, now)
                replay.note_late_starts(new_batch, now)
                continue
        loops += 1
        if loops % 512 == 0 and replay.median_delay_exceeded(now):
            stopped = True
            break
        next_s = replay.next_event_s(now)
        if next_s is None:
            break  # the last results just came back
        now = next_s
    return SimulationResult(
        requests=replay.records,
        tbt_gaps_s=replay.gaps,
        stage_busy_s=list(pipeline.stage_busy_s),
        start_s=requests[0].arrival_s if requests else 0.0,
        end_s=max(now, pipeline.last_busy_end_s),
        num_batches=pipeline.num_batches,
        num_preemptions=scheduler.num_preemptions,
        num_rejected=replay.num_rejected,
        stopped_early=stopped,
        stage_intervals=pipeline.stage_intervals,
        steady_window_s=pipeline.steady_window_s,
        steady_stage_busy_s=list(pipeline.steady_busy_s),
    )


class _Replay:
    """run_simulation's state and the steps of its loop (the engine's side effects, simulated)."""

    def __init__(
        self,
        scheduler: Scheduler,
        pipeline: SimulatedPipeline,
        requests: Sequence[SimRequest],
        stop_delay_s: float | None,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.scheduler = scheduler
        self.pipeline = pipeline
        self.requests = requests
        self.stop_delay_s = stop_delay_s
        self.progress = progress
        self.next_arrival = 0
        self.num_rejected = 0
        self.records: list[RequestRecord] = []
        self.gaps: array[float] = array("d")
        self._last_token_s: dict[int, float] = {}
        self._late_seq_ids: set[int] = set()

    def apply_results(self, now: float) -> None:
        """Micro-batches back by now: their tokens applied, gaps and finished requests kept."""
        last_token_s, gaps = self._last_token_s, self.gaps
        for done_s, batch in self.pipeline.pop_completed(now):
            sampled = dict.fromkeys(batch.yielding_seq_ids(), 0)
            for seq in self.scheduler.on_result(batch.batch_id, sampled, done_s):
                sid = seq.seq_id
                previous = last_token_s.get(sid)
                if previous is not None:
                    gaps.append(done_s - previous)
                last_token_s[sid] = done_s
                if seq.finish_reason is not None:
                    del last_token_s[sid]
                    self.records.append(
                        RequestRecord(
                            seq.arrival_time,
                            seq.first_scheduled_time or seq.arrival_time,
                            seq.first_token_time or done_s,
                            done_s,
                            len(seq.prompt_token_ids),
                            len(seq.output_token_ids),
                        )
                    )
            if self.progress is not None:
                self.progress(len(self.records))

    def admit_arrivals(self, now: float) -> None:
        requests = self.requests
        while self.next_arrival < len(requests) and requests[self.next_arrival].arrival_s <= now:
            req = requests[self.next_arrival]
            try:
                self.scheduler.add_request(
                    self.next_arrival,
                    sim_prompt(self.next_arrival, req),
                    RequestParams(max_tokens=req.num_output_tokens),
                    req.arrival_s,
                )
            except InvalidRequestError as err:
                self.num_rejected += 1
                logger.debug("request %d rejected: %s", self.next_arrival, err)
            self.next_arrival += 1

    def note_late_starts(self, batch: MicroBatch, now: float) -> None:
        """Requests this micro-batch starts later than stop_delay_s after their arrival."""
        if self.stop_delay_s is None:
            return
        # Decodes never start a prompt: only the other chunks are looked at.
        for chunk in batch.other_chunks:
            if chunk.first_position == 0 and chunk.seq_id not in self._late_seq_ids:
                admitted = self.scheduler.get(chunk.seq_id)
                if admitted is not None and now - admitted.arrival_time > self.stop_delay_s:
                    self._late_seq_ids.add(chunk.seq_id)

    def median_delay_exceeded(self, now: float) -> bool:
        """More than half the requests are known to start later than stop_delay_s."""
        if self.stop_delay_s is None:
            return False
        waiting_late = sum(
            1
            for s in self.scheduler.waiting
            if s.first_scheduled_time is None and now - s.arrival_time > self.stop_delay_s
        )
        return len(self._late_seq_ids) + waiting_late > len(self.requests) // 2

    def next_event_s(self, now: float) -> float | None:
        """Virtual time of the next arrival, completion or free stage 0; None when nothing is
        left. Raises RuntimeError when work is left but nothing can happen."""
        next_s = float("inf")
        if self.next_arrival < len(self.requests):
            next_s = self.requests[self.next_arrival].arrival_s
        completion = self.pipeline.next_completion_s
        if completion is not None and completion < next_s:
            next_s = completion
        free_s = self.pipeline.stage0_free_at_s
        if now < free_s < next_s:
            next_s = free_s
        if next_s != float("inf"):
            return next_s
        scheduler = self.scheduler
        if not scheduler.has_unfinished:
            return None
        raise RuntimeError(
            f"simulation stuck at t={now:.3f}s: {scheduler.num_waiting} waiting, "
            f"{scheduler.num_running} running, nothing in flight"
        )
