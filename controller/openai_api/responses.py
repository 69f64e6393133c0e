"""OpenAI response bodies: whole answers, stream chunks and usage, as plain JSON-ready dicts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from controller.scheduler import FinishReason

Kind = Literal["completion", "chat"]

# OpenAI has no value for "aborted": the server dropped it (shutdown, or gRPC Abort by id).
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def finish_reason_name(reason: FinishReason) -> str:
    return _FINISH_REASONS.get(reason, "abort")


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


@dataclass(frozen=True)
class ResponseIds:
    """What every body or chunk of one response repeats."""

    request_id: str
    model: str
    kind: Kind
    created_s: int = field(default_factory=lambda: int(time.time()))
    seed: int | None = None
    """Set when the request asked for return_token_ids: the seed to resume with."""

    def header(self, *, chunk: bool) -> dict[str, object]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        header: dict[str, object] = {
            "id": self.request_id,
            "object": obj,
            "created": self.created_s,
            "model": self.model,
        }
        if self.seed is not None:
            header["seed"] = self.seed
        return header


def choice_body(
    ids: ResponseIds,
    index: int,
    text: str | None,
    finish_reason: str,
    token_ids: list[int] | None = None,
    logprobs: dict[str, object] | None = None,
    tool_calls: list[dict[str, object]] | None = None,
) -> dict[str, object]:
    """One choice of a non-streamed answer; token_ids: the output's ids, when the request asked
    for them; logprobs: OpenAI's logprobs object, when it asked for them; tool_calls: chat's,
    read out of the text (which is then only what is left beside them, or None)."""
    choice: dict[str, object] = {
        "index": index,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if ids.kind == "completion":
        choice["text"] = text
    else:
        message: dict[str, object] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice["message"] = message
    return choice


def full_response(
    ids: ResponseIds, choices: list[dict[str, object]], usage_counts: dict[str, int]
) -> dict[str, object]:
    """A non-streamed answer: its choices (choice_body), in index order, and the usage."""
    return {**ids.header(chunk=False), "choices": choices, "usage": usage_counts}


def chunk(
    ids: ResponseIds,
    *,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
    include_usage: bool = False,
    token_ids: list[int] | None = None,
    logprobs: dict[str, object] | None = None,
    tool_calls: list[dict[str, object]] | None = None,
    index: int = 0,
) -> dict[str, object]:
    """One streamed delta of choice `index`. role: the chat stream's first chunk, which names
    the speaker. include_usage: the request asked for a usage chunk, so every other chunk has
    `usage: null`.
    token_ids: the ids this chunk's text came from, when the request asked for them; logprobs:
    theirs, as OpenAI's logprobs object, when it asked for them; tool_calls: chat's calls, each
    whole (with its `index`)."""
    choice: dict[str, object] = {
        "index": index,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if ids.kind == "completion":
        choice["text"] = text or ""
    else:
        delta: dict[str, object] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        choice["delta"] = delta
    body = {**ids.header(chunk=True), "choices": [choice]}
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(ids: ResponseIds, usage_counts: dict[str, int]) -> dict[str, object]:
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    return {**ids.header(chunk=True), "choices": [], "usage": usage_counts}
