"""Resuming a cut stream (GenerateRequest.resume_token_ids): the engine recomputes prompt plus the
tokens the client already has and streams only what follows, exactly the stream that was cut."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest

from controller.engine import Engine, GenerationRequest, StreamEvent, TextStream
from controller.scheduler import FinishReason, InvalidRequestError, RequestParams
from controller.tokenizer import find_stop_string, safe_to_send_len
from tests.unit.test_engine import collect, make_engine, request


def run_to_end(
    req: GenerationRequest, text_stream: Callable[[tuple[str, ...]], TextStream] | None = None
) -> tuple[list[StreamEvent], Engine]:
    async def main() -> tuple[list[StreamEvent], Engine]:
        engine, _ = make_engine()
        if text_stream is not None:
            engine.make_text_stream = lambda r: text_stream(r.stop)
        loop_task = asyncio.create_task(engine.run())
        events = await collect(engine.add(req).events)
        loop_task.cancel()
        return events, engine

    return asyncio.run(main())


def token_ids(events: list[StreamEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_a_resumed_stream_is_the_rest_of_the_uncut_one() -> None:
    full, _ = run_to_end(request("r", prompt_len=5, max_tokens=10))
    full_ids = token_ids(full)
    for cut in (1, 4, 9):
        resumed = dataclasses.replace(
            request("r", prompt_len=5, max_tokens=10), resume_token_ids=tuple(full_ids[:cut])
        )
        events, engine = run_to_end(resumed)
        assert token_ids(events) == full_ids[cut:], f"cut after {cut}"
        assert "".join(e.text for e in events) == "".join(e.text for e in full)[cut:]
        last = events[-1]
        assert last.finish_reason is FinishReason.LENGTH
        assert last.num_output_tokens == 10  # the whole output, the resumed part included
        bm = engine.scheduler.block_manager
        assert bm.num_free == bm.num_blocks


def test_the_first_micro_batch_recomputes_prompt_and_received_tokens() -> None:
    async def main() -> int:
        engine, pipeline = make_engine(budget=64)
        loop_task = asyncio.create_task(engine.run())
        resumed = dataclasses.replace(
            request("r", prompt_len=5, max_tokens=10), resume_token_ids=(5, 6, 7)
        )
        await collect(engine.add(resumed).events)
        loop_task.cancel()
        return sum(c.num_tokens for c in pipeline.batches[0].chunks)

    assert asyncio.run(main()) == 5 + 3


class HoldingStream:
    """Token t is chr(ord('a') + t % 26); text that may start a stop string is held back, with
    the real TextStream's rules (controller/tokenizer.py)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""

    def push(self, token_id: int) -> tuple[str, bool]:
        self.pending += chr(ord("a") + token_id % 26)
        found = find_stop_string(self.pending, self.stops)
        if found is not None:
            return self.pending[: found[0]], True
        cut = safe_to_send_len(self.pending, self.stops)
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False

    def finish(self) -> str:
        text, self.pending = self.pending, ""
        return text


def test_text_held_back_before_the_cut_is_sent_after_it() -> None:
    # The stop string "jz" never appears, but "j" (token 9) is held back as its possible start
    # until the next token shows otherwise: a cut right after token 9 must not lose it.
    stop = ("jz",)
    full, _ = run_to_end(request("r", prompt_len=5, max_tokens=8, stop=stop), HoldingStream)
    assert [e.text for e in full][4:6] == ["", "jk"]  # "j" was held back, then released
    received = token_ids(full)[:5]  # the client saw "fghi"
    resumed = dataclasses.replace(
        request("r", prompt_len=5, max_tokens=8, stop=stop), resume_token_ids=tuple(received)
    )
    events, _ = run_to_end(resumed, HoldingStream)
    assert "".join(e.text for e in events) == "jklm"


@pytest.mark.parametrize(
    ("resume", "params", "stop", "why"),
    [
        ((5, 6, 7, 8), RequestParams(max_tokens=4), (), "reach max_tokens"),
        ((5, 6), RequestParams(max_tokens=8, stop_token_ids=frozenset({6})), (), "stop token"),
        ((5, 6, 7), RequestParams(max_tokens=8), ("gh",), "stop string"),
    ],
)
def test_a_stream_that_had_ended_cannot_be_resumed(
    resume: tuple[int, ...], params: RequestParams, stop: tuple[str, ...], why: str
) -> None:
    engine, _ = make_engine()
    req = GenerationRequest("r", list(range(5)), params, stop, resume)
    with pytest.raises(InvalidRequestError) as err:
        engine.add(req)
    assert err.value.field == "resume_token_ids", why
    assert engine.scheduler.num_waiting == 0  # nothing queued
    assert engine.running_request_ids() == []


def test_a_resumed_stream_s_mean_tbt_spans_only_the_tokens_it_streamed() -> None:
    """Ten tokens resumed, two new ones a second apart: the mean time between tokens is the
    one second between those two, not that second over the eleven gaps of all twelve."""
    from controller.scheduler import CacheConfig, Scheduler, SchedulerConfig
    from tests.unit.test_engine import CharStream, FakePipeline

    now = [0.0]
    sched = Scheduler(
        SchedulerConfig(budget_tokens=64, tile_tokens=1, max_num_seqs=8),
        CacheConfig(num_blocks=64, block_size=16),
    )
    engine = Engine(sched, FakePipeline(), lambda r: CharStream(r.stop), clock=lambda: now[0])
    resumed = tuple(range(5, 15))
    handle = engine.add(
        GenerationRequest("r", list(range(5)), RequestParams(max_tokens=12), (), resumed)
    )
    for at in (1.0, 2.0):
        batch = sched.schedule(now[0])
        assert batch is not None
        now[0] = at
        engine.on_result(batch.batch_id, {batch.chunks[0].seq_id: 20})
        engine.stream_pending()
    events = [handle.events.get_nowait() for _ in range(handle.events.qsize())]
    assert len(events) == 2 and events[-1].finish_reason is FinishReason.LENGTH
    assert events[-1].num_output_tokens == 12
    assert events[-1].mean_tbt_s == pytest.approx(1.0)
