"""The engine loop against a fake in-process pipeline: streaming, stops, aborts, pipelining."""

from __future__ import annotations

import asyncio

from controller.engine import Engine, GenerationRequest, StreamEvent
from controller.scheduler import (
    CacheConfig,
    FinishReason,
    MicroBatch,
    RequestParams,
    Scheduler,
    SchedulerConfig,
)


class CharStream:
    """Token t is the character chr(ord('a') + t % 26); stop strings as the real TextStream."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""
        self.sent = 0

    def push(self, token_id: int) -> tuple[str, bool]:
        self.text += chr(ord("a") + token_id % 26)
        for stop in self.stops:
            if stop in self.text:
                cut = self.text.index(stop)
                out, self.sent = self.text[self.sent : cut], cut
                return out, True
        out, self.sent = self.text[self.sent :], len(self.text)
        return out, False

    def finish(self) -> str:
        return ""


class FakePipeline:
    """Returns token (position + 1) for every yielding chunk, one event-loop turn later."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.batches: list[MicroBatch] = []
        self.max_inflight = 0
        self._inflight = 0

    async def submit(self, batch: MicroBatch) -> None:
        self.batches.append(batch)
        self._inflight += 1
        self.max_inflight = max(self.max_inflight, self._inflight)
        sampled = {c.seq_id: c.context_len for c in batch.chunks if c.yields_token}
        asyncio.get_running_loop().call_later(0.001, self._complete, batch.batch_id, sampled)

    def _complete(self, batch_id: int, sampled: dict[int, int]) -> None:
        self._inflight -= 1
        assert self.engine is not None
        self.engine.on_result(batch_id, sampled)


def make_engine(pp: int = 1, budget: int = 32) -> tuple[Engine, FakePipeline]:
    sched = Scheduler(
        SchedulerConfig(budget_tokens=budget, tile_tokens=1, max_num_seqs=8, pipeline_depth=pp),
        CacheConfig(num_blocks=256, block_size=16),
    )
    pipeline = FakePipeline()
    engine = Engine(sched, pipeline, lambda r: CharStream(r.stop))
    pipeline.engine = engine
    return engine, pipeline


def request(
    rid: str, prompt_len: int, max_tokens: int, stop: tuple[str, ...] = ()
) -> GenerationRequest:
    return GenerationRequest(
        rid, list(range(prompt_len)), RequestParams(max_tokens=max_tokens), stop
    )


async def collect(queue: asyncio.Queue[StreamEvent]) -> list[StreamEvent]:
    events = []
    while True:
        event = await asyncio.wait_for(queue.get(), 5)
        events.append(event)
        if event.finish_reason is not None:
            return events


def test_tokens_stream_one_event_each_and_end_with_figures() -> None:
    async def main() -> list[StreamEvent]:
        engine, _ = make_engine()
        loop_task = asyncio.create_task(engine.run())
        handle = engine.add(request("r1", prompt_len=5, max_tokens=4))
        events = await collect(handle.events)
        loop_task.cancel()
        return events

    events = asyncio.run(main())
    assert [e.token_ids for e in events] == [[5], [6], [7], [8]]
    assert "".join(e.text for e in events) == "fghi"
    last = events[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert last.num_prompt_tokens == 5 and last.num_output_tokens == 4
    assert last.ttft_s > 0 and last.mean_tbt_s > 0


def test_stop_string_finishes_the_sequence_and_frees_its_blocks() -> None:
    async def main() -> tuple[list[StreamEvent], Engine]:
        engine, _ = make_engine()
        loop_task = asyncio.create_task(engine.run())
        handle = engine.add(request("r1", prompt_len=5, max_tokens=20, stop=("i",)))
        events = await collect(handle.events)
        loop_task.cancel()
        return events, engine

    events, engine = asyncio.run(main())
    assert "".join(e.text for e in events) == "fgh"  # ends right before the stop string
    assert events[-1].finish_reason is FinishReason.STOP
    assert engine.scheduler.block_manager.num_free == engine.scheduler.block_manager.num_blocks


def test_abort_ends_the_stream_and_frees_blocks() -> None:
    async def main() -> tuple[list[StreamEvent], Engine]:
        engine, _ = make_engine()
        loop_task = asyncio.create_task(engine.run())
        handle = engine.add(request("r1", prompt_len=5, max_tokens=1000))
        await asyncio.wait_for(handle.events.get(), 5)
        assert engine.abort("r1")
        assert not engine.abort("r1")  # already gone
        events = await collect(handle.events)
        await asyncio.sleep(0.01)  # results still in flight are ignored
        loop_task.cancel()
        return events, engine

    events, engine = asyncio.run(main())
    assert events[-1].finish_reason is FinishReason.ABORT
    assert engine.scheduler.block_manager.num_free == engine.scheduler.block_manager.num_blocks
    assert engine.num_active_requests == 0


def test_engine_keeps_the_pipeline_full() -> None:
    # A long prompt is chunked, and chunks follow each other without waiting: pp in flight.
    async def main() -> FakePipeline:
        engine, pipeline = make_engine(pp=3, budget=16)
        loop_task = asyncio.create_task(engine.run())
        handle = engine.add(request("r1", prompt_len=100, max_tokens=2))
        await collect(handle.events)
        loop_task.cancel()
        return pipeline

    pipeline = asyncio.run(main())
    assert pipeline.max_inflight == 3


def test_duplicate_request_id_is_refused() -> None:
    async def main() -> None:
        engine, _ = make_engine()
        engine.add(request("same", prompt_len=3, max_tokens=5))
        try:
            engine.add(request("same", prompt_len=3, max_tokens=5))
        except ValueError as err:
            assert "already running" in str(err)
        else:
            raise AssertionError("duplicate id accepted")

    asyncio.run(main())


def test_a_stop_string_streamed_after_a_later_result_ends_the_stream_as_a_stop() -> None:
    """Two micro-batches in flight (decodes ahead): the result after the one whose token
    completes a stop string can be applied before that token streams, and may end the sequence
    by length. The stream ends at the stop string all the same, as a stop, counting the tokens
    up to the one that hit it."""
    sched = Scheduler(
        SchedulerConfig(budget_tokens=32, tile_tokens=1, max_num_seqs=8, decode_ahead=True),
        CacheConfig(num_blocks=64, block_size=16),
    )
    engine = Engine(sched, FakePipeline(), lambda r: CharStream(r.stop))
    handle = engine.add(request("r1", prompt_len=5, max_tokens=4, stop=("h",)))
    # tokens 5, 6, 7, 8 are "f", "g", "h", "i": "h" hits the stop, "i" is the last by length
    batches = [sched.schedule(0.0), sched.schedule(0.0)]  # the prompt, its first decode ahead
    for token in (5, 6, 7, 8):
        batch = batches.pop(0)
        assert batch is not None
        engine.on_result(batch.batch_id, {batch.chunks[0].seq_id: token})
        batches.append(sched.schedule(0.0))
        if token < 7:
            engine.stream_pending()
    engine.stream_pending()  # "h" and "i" at once
    events = []
    while not handle.events.empty():
        events.append(handle.events.get_nowait())
    assert "".join(e.text for e in events) == "fg"
    assert events[-1].finish_reason is FinishReason.STOP
    assert events[-1].num_output_tokens == 3
