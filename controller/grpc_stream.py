"""One Generate call's responses: the engine's events as GenerateResponse messages."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from sarathi_proto import generate_pb2

from controller.engine import GenerationRequest, RequestHandle, StreamEvent
from controller.scheduler import FinishReason
from controller.tool_calls import ToolSpec, parse_tool_calls

_FINISH = {
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT,
}


class ShuttingDown(Exception):
    """The controller aborted the request to shut down: the call ends UNAVAILABLE (retry)."""


class RequestFailed(Exception):
    """The request's step failed on the workers, alone too (quarantine.py): the call ends
    INTERNAL with the reason; retrying the same request would fail the same way."""


async def responses(
    handle: RequestHandle,
    generation: GenerationRequest,
    tools: ToolSpec | None,
    shutting_down: Callable[[], bool],
) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """Every choice's messages as they come, until each has ended (with tools, its last message
    lists its calls); raises ShuttingDown when the controller's shutdown aborted the request,
    RequestFailed when the quarantine ended it."""
    # Each choice's first message says which seed it runs with, for a resume.
    unseeded = set(range(generation.n))
    texts: list[list[str]] = [[] for _ in range(generation.n)]
    num_ended = 0  # read, not queued: handle.finished may be true with events still queued
    while num_ended < generation.n:
        event = await handle.events.get()
        if event.finish_reason is FinishReason.ERROR:
            raise RequestFailed(event.error)  # the engine aborted the other choices
        num_ended += event.finish_reason is not None
        response = to_response(handle.request_id, event)
        if event.choice in unseeded:
            unseeded.discard(event.choice)
            response.seed = generation.choice_params(event.choice).sampling.seed
        if event.finish_reason is FinishReason.ABORT and shutting_down():
            raise ShuttingDown
        if tools is not None:
            texts[event.choice].append(event.text)
            if event.finish_reason is not None:
                _, calls = parse_tool_calls("".join(texts[event.choice]), tools)
                for call in calls:
                    function = call["function"]
                    response.tool_calls.add(
                        id=call["id"], name=function["name"], arguments=function["arguments"]
                    )
        yield response


def to_response(request_id: str, event: StreamEvent) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(
        request_id=request_id, text=event.text, token_ids=event.token_ids, index=event.choice
    )
    if event.prompt_logprobs is not None:
        for lp in event.prompt_logprobs:
            response.prompt_logprobs.add(
                logprob=lp.logprob, top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs
            )
    if event.logprobs is not None:
        lp = event.logprobs
        response.logprobs.add(
            logprob=lp.logprob, top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs
        )
    if event.finish_reason is not None:
        response.finish_reason = _FINISH[event.finish_reason]
        response.ttft_s = event.ttft_s
        response.mean_tbt_s = event.mean_tbt_s
        response.num_prompt_tokens = event.num_prompt_tokens
        response.num_output_tokens = event.num_output_tokens
        response.scheduling_delay_s = event.scheduling_delay_s
    return response
