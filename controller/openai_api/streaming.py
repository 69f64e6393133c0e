"""Answers from a RequestHandle's events: server-sent events, or one body at the end.

Both watch the connection while they wait: a client that goes away aborts its sequence at once
(freeing its KV blocks at the next step), not when the next token would have been sent. That
includes a client that times out a long non-streamed request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import Receive

from controller.engine import RequestHandle, StreamEvent
from controller.logprobs import TokenLogprobs
from controller.openai_api.logprobs import LogprobsFormatter
from controller.openai_api.responses import (
    ResponseIds,
    chunk,
    finish_reason_name,
    usage,
    usage_chunk,
)
from controller.openai_api.state import EngineLike

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


def sse(body: dict[str, object]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _logprobs_of(
    event: StreamEvent, formatter: LogprobsFormatter | None
) -> dict[str, object] | None:
    if formatter is None or event.logprobs is None:
        return None
    return formatter.format(event.token_ids, [event.logprobs])


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the ASGI server reports the client gone (the body is already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectWatch:
    """Aborts a request when its client disconnects; close() once the answer is complete."""

    def __init__(self, receive: Receive, engine: EngineLike, handle: RequestHandle) -> None:
        self.engine = engine
        self.handle = handle
        self._task = asyncio.create_task(self._watch(receive), name=f"watch-{handle.request_id}")

    async def _watch(self, receive: Receive) -> None:
        await wait_for_disconnect(receive)
        if not self.handle.finished:
            log.info("client of %s went away: aborting it", self.handle.request_id)
            self.engine.abort(self.handle.request_id)

    @property
    def disconnected(self) -> bool:
        return self._task.done() and not self._task.cancelled()

    def close(self) -> None:
        """Stops watching; a request still running here was given up on: abort it."""
        self._task.cancel()
        if not self.handle.finished:
            self.engine.abort(self.handle.request_id)


@dataclass
class Answer:
    """A whole answer, collected."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    """One per token, when the request asked for them (else empty)."""
    last: StreamEvent
    """The last event: finish reason and counts."""


async def collect(handle: RequestHandle, engine: EngineLike, receive: Receive) -> Answer:
    """Waits for the whole answer."""
    watch = DisconnectWatch(receive, engine, handle)
    parts = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] = []
    try:
        while True:
            event = await handle.events.get()
            parts.append(event.text)
            token_ids += event.token_ids
            if event.logprobs is not None:
                logprobs.append(event.logprobs)
            if event.finish_reason is not None:
                return Answer("".join(parts), token_ids, logprobs, event)
    finally:
        watch.close()


async def sse_stream(
    ids: ResponseIds,
    handle: RequestHandle,
    engine: EngineLike,
    receive: Receive,
    include_usage: bool,
    return_token_ids: bool = False,
    logprobs: LogprobsFormatter | None = None,
) -> AsyncIterator[str]:
    """The request's chunks as SSE lines, then `data: [DONE]`. Cancelled (the response task
    stopped) or closed early, the `finally` aborts the sequence. return_token_ids: every token
    gets a chunk with its id, even one whose text is held back (a client resuming a cut stream
    needs every id); with `logprobs`, every token's chunk carries its log-probabilities."""
    watch = DisconnectWatch(receive, engine, handle)
    try:
        if ids.kind == "chat":  # OpenAI's first chat chunk names the speaker before any text
            yield sse(chunk(ids, text="", role=True, include_usage=include_usage))
        while True:
            event = await handle.events.get()
            every_token = return_token_ids or logprobs is not None
            if event.text or (every_token and event.token_ids):
                yield sse(
                    chunk(
                        ids,
                        text=event.text,
                        include_usage=include_usage,
                        token_ids=event.token_ids if return_token_ids else None,
                        logprobs=_logprobs_of(event, logprobs),
                    )
                )
            if event.finish_reason is None:
                continue
            if watch.disconnected:
                return  # nobody is listening for the end
            reason = finish_reason_name(event.finish_reason)
            last_text = "" if ids.kind == "completion" else None
            yield sse(chunk(ids, text=last_text, finish_reason=reason, include_usage=include_usage))
            if include_usage:
                counts = usage(event.num_prompt_tokens, event.num_output_tokens)
                yield sse(usage_chunk(ids, counts))
            yield SSE_DONE
            return
    finally:
        watch.close()
