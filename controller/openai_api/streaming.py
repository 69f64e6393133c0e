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
from dataclasses import dataclass, field

from starlette.types import Receive

from controller.engine import RequestHandle, StreamEvent
from controller.logprobs import TokenLogprobs
from controller.openai_api.errors import request_failed
from controller.openai_api.logprobs import LogprobsFormatter
from controller.openai_api.responses import (
    ResponseIds,
    chunk,
    finish_reason_name,
    usage,
    usage_chunk,
)
from controller.openai_api.state import EngineLike
from controller.openai_api.validation import Echo
from controller.scheduler import FinishReason
from controller.tool_calls import ToolSpec, parse_tool_calls

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


def sse(body: dict[str, object]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _logprobs_of(
    event: StreamEvent, formatter: LogprobsFormatter | None
) -> dict[str, object] | None:
    if formatter is None or event.logprobs is None:
        return None
    return formatter.format(event.token_ids, [event.logprobs], event.choice)


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
    """A whole answer of one choice, collected."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    """One per token, when the request asked for them (else empty)."""
    prompt_logprobs: tuple[TokenLogprobs, ...]
    """The prompt's from its second token on, when asked (else empty; choice 0 carries them)."""
    last: StreamEvent
    """The last event: finish reason and counts."""


@dataclass
class _Collecting:
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    def add(self, event: StreamEvent) -> Answer | None:
        """Takes one event; the whole answer once it is the last."""
        self.parts.append(event.text)
        self.token_ids += event.token_ids
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.finish_reason is None:
            return None
        return Answer(
            "".join(self.parts), self.token_ids, self.logprobs, self.prompt_logprobs, event
        )


async def collect(handle: RequestHandle, engine: EngineLike, receive: Receive) -> list[Answer]:
    """Waits for every choice's whole answer; returns them in index order."""
    watch = DisconnectWatch(receive, engine, handle)
    collecting = [_Collecting() for _ in range(handle.n)]
    answers: dict[int, Answer] = {}
    try:
        while len(answers) < handle.n:
            event = await handle.events.get()
            if event.finish_reason is FinishReason.ERROR:
                raise request_failed(event.error)  # the engine aborted the other choices
            answer = collecting[event.choice].add(event)
            if answer is not None:
                answers[event.choice] = answer
        return [answers[i] for i in range(handle.n)]
    finally:
        watch.close()


@dataclass(frozen=True)
class StreamOptions:
    """What a streamed answer carries beyond text."""

    include_usage: bool = False
    """A last chunk with `usage` (and `usage: null` on every other one)."""
    return_token_ids: bool = False
    """Every token gets a chunk with its id, even one whose text is held back (a client
    resuming a cut stream needs every id)."""
    logprobs: LogprobsFormatter | None = None
    """Every token's chunk carries its log-probabilities."""
    echo: Echo | None = None
    """The first chunk is the prompt (with its log-probabilities); with prompt_only, the only
    one."""
    tools: ToolSpec | None = None
    """Chat with tools: the text is held until the end, then sent as content and tool calls
    (a call is only known whole once its block closes)."""


async def sse_stream(
    ids: ResponseIds,
    handle: RequestHandle,
    engine: EngineLike,
    receive: Receive,
    options: StreamOptions,
) -> AsyncIterator[str]:
    """The request's chunks as SSE lines: each choice's deltas as they come (each naming its
    index), its finishing chunk when it ends, and after the last one the usage (when asked)
    and `data: [DONE]`. Cancelled (the response task stopped) or closed early, the `finally`
    aborts the request."""
    watch = DisconnectWatch(receive, engine, handle)
    n = handle.n
    choices = [_ChoiceState(options.echo) for _ in range(n)]
    num_prompt = num_output = num_ended = 0
    try:
        if ids.kind == "chat":  # OpenAI's first chat chunk names the speaker before any text
            for index in range(n):
                yield sse(
                    chunk(ids, text="", role=True, include_usage=options.include_usage, index=index)
                )
        while num_ended < n:
            event = await handle.events.get()
            if event.finish_reason is FinishReason.ERROR:
                # OpenAI's SDKs raise an APIError for a chunk with `error`; the engine aborted
                # the other choices, so the stream ends here.
                yield sse(request_failed(event.error).to_json())
                yield SSE_DONE
                return
            state = choices[event.choice]
            for line in state.lines(ids, options, event):
                yield line
            if not state.ended:
                continue
            num_ended += 1
            if watch.disconnected:  # nobody is listening for the end
                return
            num_prompt = state.num_prompt
            num_output += state.num_output
        if options.include_usage:
            yield sse(usage_chunk(ids, usage(num_prompt, num_output)))
        yield SSE_DONE
    finally:
        watch.close()


class _ChoiceState:
    """One choice of a streamed answer: its echo still to send, and its text held for tools."""

    def __init__(self, echo: Echo | None) -> None:
        self.echo = echo
        self.held: list[str] = []
        self.held_token_ids: list[int] = []
        self.held_logprobs: list[tuple[int, TokenLogprobs]] = []
        """With tools: the tokens and log-probabilities the held text came with, for the one
        content chunk the tool calls are read from."""
        self.ended = False
        self.num_prompt = 0
        self.num_output = 0

    def lines(self, ids: ResponseIds, options: StreamOptions, event: StreamEvent) -> list[str]:
        """The SSE lines for one of this choice's events."""
        if self.ended:
            return []  # a prompt-only echo already ended this choice
        index, usage_null = event.choice, options.include_usage
        lines = []
        echo, self.echo = self.echo, None
        if echo is not None:
            lines.append(sse(_echo_chunk(ids, options, echo, event)))
            if echo.prompt_only:
                self._end(len(echo.prompt_token_ids), 0)
                return [*lines, _finishing(ids, options, "length", index)]
        if options.tools is not None:
            self.hold(event)
        elif event.text or (event.token_ids and (options.return_token_ids or options.logprobs)):
            token_ids = event.token_ids if options.return_token_ids else None
            logprobs = _logprobs_of(event, options.logprobs)
            lines.append(
                sse(
                    chunk(
                        ids,
                        text=event.text,
                        include_usage=usage_null,
                        token_ids=token_ids,
                        logprobs=logprobs,
                        index=index,
                    )
                )
            )
        if event.finish_reason is None:
            return lines
        self._end(event.num_prompt_tokens, event.num_output_tokens)
        reason = finish_reason_name(event.finish_reason)
        if options.tools is not None:
            content, calls = parse_tool_calls("".join(self.held), options.tools)
            lines.append(sse(self._held_chunk(ids, options, content, calls, index)))
            reason = "tool_calls" if calls else reason
        return [*lines, _finishing(ids, options, reason, index)]

    def hold(self, event: StreamEvent) -> None:
        self.held.append(event.text)
        self.held_token_ids += event.token_ids
        if event.logprobs is not None:
            self.held_logprobs += [(t, event.logprobs) for t in event.token_ids]

    def _held_chunk(
        self,
        ids: ResponseIds,
        options: StreamOptions,
        content: str | None,
        calls: list[dict[str, object]],
        index: int,
    ) -> dict[str, object]:
        """With tools: the whole answer as one chunk, the text read for tool calls, with the
        token ids and log-probabilities the unstreamed answer carries."""
        logprobs = None
        if options.logprobs is not None and self.held_logprobs:
            token_ids, entries = zip(*self.held_logprobs, strict=True)
            logprobs = options.logprobs.format(token_ids, entries, index)
        return chunk(
            ids,
            text=content,
            include_usage=options.include_usage,
            token_ids=self.held_token_ids if options.return_token_ids else None,
            logprobs=logprobs,
            tool_calls=calls,
            index=index,
        )

    def _end(self, num_prompt: int, num_output: int) -> None:
        self.ended = True
        self.num_prompt, self.num_output = num_prompt, num_output


def _echo_chunk(
    ids: ResponseIds, options: StreamOptions, echo: Echo, event: StreamEvent
) -> dict[str, object]:
    prompt_logprobs = None
    if options.logprobs is not None and event.prompt_logprobs is not None:
        prompt_logprobs = options.logprobs.format_prompt(
            echo.prompt_token_ids, event.prompt_logprobs, event.choice
        )
    return chunk(
        ids,
        text=echo.prompt_text,
        include_usage=options.include_usage,
        logprobs=prompt_logprobs,
        index=event.choice,
    )


def _finishing(ids: ResponseIds, options: StreamOptions, reason: str, index: int) -> str:
    """A choice's last chunk: its finish reason."""
    last_text = "" if ids.kind == "completion" else None
    return sse(
        chunk(
            ids,
            text=last_text,
            finish_reason=reason,
            include_usage=options.include_usage,
            index=index,
        )
    )
