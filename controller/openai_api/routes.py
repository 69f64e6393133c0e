"""The Starlette application: routes, and the order of checks every generation request passes.

auth (401) -> pipeline ready (503) -> body and field checks (400/404) -> admission (429) ->
engine.add -> stream or wait. Nothing is queued unless every check passed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from controller.admission import PipelineDownError, QueueFullError
from controller.api_request import RequestLimits
from controller.logprobs import TokenLogprobs
from controller.openai_api.errors import (
    ApiError,
    error_response,
    invalid_request,
    not_ready,
    queue_full,
)
from controller.openai_api.logprobs import LogprobsFormatter
from controller.openai_api.responses import (
    Kind,
    ResponseIds,
    choice_body,
    finish_reason_name,
    full_response,
    usage,
)
from controller.openai_api.state import HttpApiState
from controller.openai_api.streaming import Answer, StreamOptions, collect, sse_stream
from controller.openai_api.validation import ParsedRequest, parse_chat, parse_completion
from controller.scheduler import InvalidRequestError
from controller.tokenizer import Tokenizer
from controller.tool_calls import parse_tool_calls

log = logging.getLogger(__name__)

Parser = Callable[[object, str, RequestLimits, Tokenizer], ParsedRequest]
_PARSERS: dict[Kind, Parser] = {"completion": parse_completion, "chat": parse_chat}


def build_app(state: HttpApiState) -> Starlette:
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")

    async def models(request: Request) -> Response:
        state.authenticate(request.headers.get("authorization"))
        model = {
            "id": state.model_name,
            "object": "model",
            "created": state.created_s,
            "owned_by": "sarathi-cluster",
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def health(request: Request) -> Response:
        # Load balancers and Kubernetes probes: 200 only while requests can be served.
        if not state.ready:
            return error_response(ApiError(503, "the pipeline is not ready", code="not_ready"))
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        # Prometheus and inference gateways scrape here, as they do vLLM; like /health it needs
        # no API key (vLLM's /metrics does not either), and it answers while the pipeline is down.
        if state.metrics is None:
            return error_response(ApiError(404, "this controller exports no metrics"))
        body, content_type = state.metrics()
        return Response(body, media_type=content_type)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _unexpected_error,
        },
    )


async def _generate(state: HttpApiState, request: Request, kind: Kind) -> Response:
    state.authenticate(request.headers.get("authorization"))
    serving = state.require_serving()
    try:
        raw = await read_body(request)
    except ClientDisconnect as err:  # gone before its body was whole: nobody to answer, no fault
        raise ApiError(400, "the client disconnected before sending the whole body") from err
    try:
        body = json.loads(raw)
    # ValueError: JSONDecodeError, UnicodeDecodeError, and a number past int()'s digit limit;
    # RecursionError: arrays or objects nested past the parser's depth.
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from err
    parsed = _PARSERS[kind](body, state.model_name, serving.limits, serving.tokenizer)
    state.admit()
    try:
        handle = serving.engine.add(parsed.generation)
    except QueueFullError as err:
        raise queue_full(err.retry_after_s) from err
    except PipelineDownError as err:
        raise not_ready(err.retry_after_s) from err
    except InvalidRequestError as err:  # the scheduler's checks: prompt + max_tokens too long
        if (name := parsed.field_names.get(err.field)) is not None:
            err = InvalidRequestError(name, str(err).removeprefix(f"{err.field}: "))
        raise invalid_request(err) from err
    sampling = parsed.generation.params.sampling
    seed = sampling.seed if parsed.return_token_ids else None
    ids = ResponseIds(handle.request_id, state.model_name, kind, seed=seed)
    formatter = None
    if sampling.top_logprobs is not None and parsed.show_logprobs:
        formatter = LogprobsFormatter(serving.tokenizer, kind)
    if parsed.stream:
        options = StreamOptions(
            parsed.include_usage, parsed.return_token_ids, formatter, parsed.echo, parsed.tools
        )
        return StreamingResponse(
            sse_stream(ids, handle, serving.engine, request.receive, options),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    answers = await collect(handle, serving.engine, request.receive)
    return JSONResponse(whole_answer(ids, parsed, answers, formatter))


def whole_answer(
    ids: ResponseIds,
    parsed: ParsedRequest,
    answers: list[Answer],
    formatter: LogprobsFormatter | None,
) -> dict[str, object]:
    """A non-streamed body: every choice (with best_of, the n most likely of those run), and
    the usage of all that ran."""
    num_prompt = answers[0].last.num_prompt_tokens
    prompt_only = parsed.echo is not None and parsed.echo.prompt_only
    num_output = 0 if prompt_only else sum(a.last.num_output_tokens for a in answers)
    shown = answers
    if len(answers) > parsed.n:  # best_of: the highest sum of sampled-token log-probabilities
        shown = sorted(answers, key=lambda a: -sum(lp.logprob for lp in a.logprobs))
        shown = shown[: parsed.n]
    prompt_logprobs = answers[0].prompt_logprobs  # choice 0 scored the prompt
    choices = [
        _choice(ids, parsed, i, answer, prompt_logprobs, formatter)
        for i, answer in enumerate(shown)
    ]
    return full_response(ids, choices, usage(num_prompt, num_output))


def _choice(
    ids: ResponseIds,
    parsed: ParsedRequest,
    index: int,
    answer: Answer,
    prompt_logprobs: tuple[TokenLogprobs, ...],
    formatter: LogprobsFormatter | None,
) -> dict[str, object]:
    """One choice: with echo, the prompt first (alone, for max_tokens 0)."""
    last = answer.last
    assert last.finish_reason is not None
    echo = parsed.echo
    text, token_ids, logprobs = answer.text, answer.token_ids, answer.logprobs
    reason = finish_reason_name(last.finish_reason)
    if echo is not None and echo.prompt_only:
        text, token_ids, logprobs, reason = "", [], [], "length"
    shown_logprobs = None
    if formatter is not None:
        prompt = None  # text offsets run on: the echoed prompt's come first
        if echo is not None:
            prompt = formatter.format_prompt(echo.prompt_token_ids, prompt_logprobs, index)
        shown_logprobs = formatter.format(token_ids, logprobs, index)
        if prompt is not None:
            shown_logprobs = formatter.join(prompt, shown_logprobs)
    if echo is not None:
        text = echo.prompt_text + text
    shown_ids = token_ids if parsed.return_token_ids else None
    content: str | None = text
    calls: list[dict[str, object]] = []
    if parsed.tools is not None:
        content, calls = parse_tool_calls(text, parsed.tools)
        reason = "tool_calls" if calls else reason
    return choice_body(ids, index, content, reason, shown_ids, shown_logprobs, calls)


MAX_BODY_BYTES = 32 << 20
"""Largest request body read (a prompt of a million tokens as ids fits): past it, 413, read no
further, so no client makes the controller hold an unbounded body."""


async def read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        parts.append(part)
    return b"".join(parts)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    # Unknown paths and wrong methods, in the same JSON shape as every other error.
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(ApiError(exc.status_code, message))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error answering %s %s", request.method, request.url.path)
    return error_response(ApiError(500, "internal server error", error_type="server_error"))
