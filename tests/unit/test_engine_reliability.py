"""Engine under overload, cancellation storms and a lost pipeline, against a fake pipeline."""

from __future__ import annotations

import asyncio

import pytest

from controller.admission import (
    AdmissionConfig,
    PipelineDownError,
    QueueFullError,
    WhileDown,
)
from controller.engine import Engine, GenerationRequest, StreamEvent
from controller.overload_watch import OverloadTracker, watch_overload
from controller.scheduler import (
    CacheConfig,
    ConfigError,
    FinishReason,
    MicroBatch,
    RequestParams,
    Scheduler,
    SchedulerConfig,
)
from tests.unit.test_engine import CharStream, FakePipeline, collect, request


class LossyPipeline:
    """Like FakePipeline, but drop_all() loses every batch in flight (a stage died)."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self._pending: list[asyncio.TimerHandle] = []

    async def submit(self, batch: MicroBatch) -> None:
        sampled = {c.seq_id: c.context_len for c in batch.chunks if c.yields_token}
        loop = asyncio.get_running_loop()
        self._pending.append(loop.call_later(0.002, self._complete, batch.batch_id, sampled))

    def _complete(self, batch_id: int, sampled: dict[int, int]) -> None:
        assert self.engine is not None
        self.engine.on_result(batch_id, sampled)

    def drop_all(self) -> None:
        for timer in self._pending:
            timer.cancel()
        self._pending.clear()


def make_engine(
    admission: AdmissionConfig | None = None, max_num_seqs: int = 8, pp: int = 1
) -> tuple[Engine, FakePipeline]:
    sched = Scheduler(
        SchedulerConfig(
            budget_tokens=32, tile_tokens=1, max_num_seqs=max_num_seqs, pipeline_depth=pp
        ),
        CacheConfig(num_blocks=256, block_size=16),
    )
    pipeline = FakePipeline()
    engine = Engine(sched, pipeline, lambda r: CharStream(r.stop), admission=admission)
    pipeline.engine = engine
    return engine, pipeline


def test_admission_config_names_the_bad_field() -> None:
    with pytest.raises(ConfigError, match="max_queued_requests"):
        AdmissionConfig(max_queued_requests=0)
    with pytest.raises(ConfigError, match="max_queued_prompt_tokens"):
        AdmissionConfig(max_queued_prompt_tokens=0)
    with pytest.raises(ConfigError, match="retry_after_s"):
        AdmissionConfig(retry_after_s=0.0)


def test_requests_past_the_queue_bound_are_refused_at_once_with_a_hint() -> None:
    engine, _ = make_engine(AdmissionConfig(max_queued_requests=3, retry_after_s=2.5))
    for i in range(3):
        engine.add(request(f"r{i}", prompt_len=4, max_tokens=2))
    assert engine.queue_full()
    with pytest.raises(QueueFullError, match="max_queued_requests=3") as err:
        engine.add(request("r3", prompt_len=4, max_tokens=2))
    assert err.value.retry_after_s == 2.5
    assert engine.num_active_requests == 3  # nothing was queued for the refused one


def test_queued_prompt_tokens_are_bounded_but_one_long_prompt_alone_is_served() -> None:
    engine, _ = make_engine(AdmissionConfig(max_queued_prompt_tokens=10))
    engine.add(request("long", prompt_len=50, max_tokens=2))  # the queue was empty
    with pytest.raises(QueueFullError, match="max_queued_prompt_tokens=10"):
        engine.add(request("more", prompt_len=1, max_tokens=2))


def test_ten_times_the_queue_bound_ends_every_call_with_tokens_or_a_refusal() -> None:
    async def main() -> tuple[int, int, Engine]:
        engine, _ = make_engine(AdmissionConfig(max_queued_requests=8), max_num_seqs=4)
        loop_task = asyncio.create_task(engine.run())
        served, refused = 0, 0
        handles = []
        for i in range(120):
            try:
                handles.append(engine.add(request(f"r{i}", prompt_len=6, max_tokens=3)))
            except QueueFullError:
                refused += 1
            if i % 10 == 9:
                await asyncio.sleep(0.005)
        for handle in handles:
            events = await collect(handle.events)
            assert events[-1].finish_reason is FinishReason.LENGTH
            served += 1
        loop_task.cancel()
        return served, refused, engine

    served, refused, engine = asyncio.run(main())
    assert served + refused == 120 and served >= 8 and refused > 0
    assert engine.num_active_requests == 0 and engine.scheduler.kv_usage == 0.0


def test_a_hundred_cancelled_streams_leave_no_block_in_use() -> None:
    async def main() -> Engine:
        engine, _ = make_engine(AdmissionConfig(max_queued_requests=200), max_num_seqs=16)
        loop_task = asyncio.create_task(engine.run())
        handles = [engine.add(request(f"c{i}", prompt_len=20, max_tokens=500)) for i in range(100)]
        await asyncio.wait_for(handles[0].events.get(), 5)
        for handle in handles:
            engine.abort(handle.request_id)
        await asyncio.sleep(0.02)  # results still in flight come back and are ignored
        loop_task.cancel()
        return engine

    engine = asyncio.run(main())
    assert engine.scheduler.kv_usage == 0.0
    assert engine.num_active_requests == 0 and not engine.scheduler.has_unfinished


def test_streams_continue_without_gap_or_repeat_across_a_lost_pipeline() -> None:
    async def run(lose_pipeline: bool) -> list[list[int]]:
        sched = Scheduler(
            SchedulerConfig(budget_tokens=16, tile_tokens=1, max_num_seqs=8, pipeline_depth=2),
            CacheConfig(num_blocks=256, block_size=16),
        )
        pipeline = LossyPipeline()
        engine = Engine(sched, pipeline, lambda r: CharStream(r.stop))
        pipeline.engine = engine
        loop_task = asyncio.create_task(engine.run())
        handles = [engine.add(request(f"r{i}", prompt_len=10 + i, max_tokens=40)) for i in range(3)]
        if lose_pipeline:
            await asyncio.sleep(0.015)
            pipeline.drop_all()
            assert engine.on_pipeline_down() > 0
            await asyncio.sleep(0.02)  # nothing is scheduled while down
            assert sched.num_inflight_batches == 0
            engine.on_pipeline_up()
        streams = []
        for handle in handles:
            events = await collect(handle.events)
            streams.append([t for e in events for t in e.token_ids])
        loop_task.cancel()
        return streams

    undisturbed = asyncio.run(run(lose_pipeline=False))
    assert asyncio.run(run(lose_pipeline=True)) == undisturbed


def test_while_down_new_requests_are_held_or_failed_as_configured() -> None:
    held, _ = make_engine(AdmissionConfig(while_down=WhileDown.HOLD))
    held.on_pipeline_down()
    held.add(request("held", prompt_len=3, max_tokens=2))
    assert held.scheduler.num_waiting == 1

    failing, _ = make_engine(AdmissionConfig(while_down=WhileDown.FAIL))
    failing.on_pipeline_down()
    with pytest.raises(PipelineDownError):
        failing.add(request("failed", prompt_len=3, max_tokens=2))


def test_stall_clock_runs_only_while_requests_wait_and_no_step_completes() -> None:
    now = [100.0]
    sched = Scheduler(
        SchedulerConfig(budget_tokens=32, tile_tokens=1, max_num_seqs=8), CacheConfig(num_blocks=64)
    )
    engine = Engine(sched, FakePipeline(), lambda r: CharStream(r.stop), clock=lambda: now[0])
    now[0] = 200.0
    assert engine.stalled_for_s() == 0.0  # idle
    engine.add(request("r", prompt_len=3, max_tokens=2))
    now[0] = 207.0
    assert engine.stalled_for_s() == 7.0


def test_a_burst_refused_and_drained_between_two_looks_is_still_one_overload() -> None:
    """The overload watch samples every 0.25 s; a burst can fill the queue, be refused and drain
    before it looks. The refusal itself must still start an overload event."""

    async def main() -> list[str]:
        engine, _ = make_engine(AdmissionConfig(max_queued_requests=2))
        for i in range(2):
            engine.add(request(f"r{i}", prompt_len=4, max_tokens=2))
        with pytest.raises(QueueFullError):
            engine.add(request("refused", prompt_len=4, max_tokens=2))
        for i in range(2):
            engine.abort(f"r{i}")  # drained before the watch's first look
        assert engine.overload_reason() == ""
        starts: list[str] = []
        watch = asyncio.create_task(
            watch_overload(engine, OverloadTracker(starts.append, lambda _: None))
        )
        await asyncio.sleep(0.6)  # two looks or more: the second finds nothing new
        watch.cancel()
        return starts

    assert asyncio.run(main()) == ["2 requests queued (max_queued_requests=2)"]


class PoisonPipeline(LossyPipeline):
    """A micro-batch holding `poison` in a chunk's tokens fails on the workers: the engine
    hears which (on_step_fault), then the pipeline goes down and comes back, as the executor
    drives it."""

    poison = 999

    async def submit(self, batch: MicroBatch) -> None:
        if not any(self.poison in c.token_ids for c in batch.chunks):
            await super().submit(batch)
            return
        assert self.engine is not None
        engine = self.engine
        loop = asyncio.get_running_loop()

        def fail() -> None:
            self.drop_all()
            engine.on_step_fault(batch.batch_id, f"micro-batch {batch.batch_id}: boom")
            engine.on_pipeline_down()
            loop.call_later(0.005, engine.on_pipeline_up)

        self._pending.append(loop.call_later(0.002, fail))


def test_a_request_that_fails_every_step_ends_with_an_error_and_the_others_are_served() -> None:
    async def run(poisoned: bool) -> tuple[list[list[int]], list[StreamEvent]]:
        sched = Scheduler(
            SchedulerConfig(budget_tokens=16, tile_tokens=1, max_num_seqs=8),
            CacheConfig(num_blocks=256, block_size=16),
        )
        pipeline = PoisonPipeline()
        engine = Engine(sched, pipeline, lambda r: CharStream(r.stop))
        pipeline.engine = engine
        loop_task = asyncio.create_task(engine.run())
        handles = [engine.add(request(f"r{i}", prompt_len=10 + i, max_tokens=30)) for i in range(2)]
        bad_events: list[StreamEvent] = []
        if poisoned:
            await asyncio.sleep(0.01)  # the others decode when it arrives
            prompt = [1, 2, PoisonPipeline.poison, 3]
            bad = engine.add(GenerationRequest("bad", prompt, RequestParams(max_tokens=5), n=2))
            for _ in range(2):  # one event per choice: the error, and the other choice aborted
                bad_events.append(await asyncio.wait_for(bad.events.get(), 5))
            assert bad.finished
        streams = []
        for handle in handles:
            events = await collect(handle.events)
            streams.append([t for e in events for t in e.token_ids])
        loop_task.cancel()
        assert engine.num_active_requests == 0 and sched.kv_usage == 0.0
        return streams, bad_events

    undisturbed, _ = asyncio.run(run(poisoned=False))
    streams, bad_events = asyncio.run(run(poisoned=True))
    assert streams == undisturbed
    reasons = sorted(e.finish_reason.value for e in bad_events if e.finish_reason)
    assert reasons == ["abort", "error"]
    [error] = [e for e in bad_events if e.finish_reason is FinishReason.ERROR]
    assert "quarantined" in error.error and "boom" in error.error, error
