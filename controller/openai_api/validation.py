"""OpenAI request bodies -> the engine's GenerationRequest, refusing what we cannot honour.

bodies.py types each field (400 naming it); everything the gRPC API also has (prompt,
max_tokens, n, sampling, stop strings) then goes through controller/api_request.py's shared
checks, so both APIs refuse a request for the same reason and name the same field. Fields we do
not implement are accepted only at their no-op value (`suffix=""`): silently ignoring one would
hand back something other than what was asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from controller.api_request import (
    Penalties,
    RequestLimits,
    build_generation_request,
    check_prompt_token_ids,
    default_max_tokens,
)
from controller.engine import GenerationRequest
from controller.grammar import compile_grammar
from controller.openai_api.bodies import (
    ChatBody,
    ChatMessage,
    CompletionBody,
    ResponseFormat,
    read_body,
)
from controller.openai_api.errors import bad_field, invalid_request
from controller.scheduler import InvalidRequestError
from controller.tokenizer import Tokenizer
from controller.tool_calls import ToolSpec, parse_tools, tool_grammar

# OpenAI's own default: sampling, not greedy (send temperature=0 for greedy).
DEFAULT_TEMPERATURE = 1.0
# OpenAI's (and vLLM's) default for /v1/completions; chat gets the server's --default-max-tokens.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class ParsedRequest:
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk with `usage` (streaming only)."""
    return_token_ids: bool = False
    """Our extension, for resuming a cut stream: each choice carries its `token_ids` and each
    body the request's sampling `seed`."""
    echo: Echo | None = None
    """Completions' echo: the answer starts with the prompt (and its log-probabilities)."""
    tools: ToolSpec | None = None
    """Chat's tools: the answer's text is read for tool calls."""
    n: int = 1
    """Choices answered; the generation runs more with best_of (and answers the n likeliest)."""
    show_logprobs: bool = True
    """False when log-probabilities were asked for only to rank best_of's choices."""
    field_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The request's own names for the shared checks' fields where the endpoint's differ
    (chat: messages for the prompt), for errors raised after parsing (the scheduler's)."""


@dataclass(frozen=True)
class Echo:
    prompt_text: str
    prompt_token_ids: list[int]
    prompt_only: bool
    """max_tokens 0: the prompt alone (one token is generated, and not shown)."""


def parse_completion(
    body: object, model_name: str, limits: RequestLimits, tokenizer: Tokenizer
) -> ParsedRequest:
    """A /v1/completions body; raises ApiError (400 naming the field, 404 for another model)."""
    fields = read_body(CompletionBody, body, model_name)
    # The shared checks name the engine's fields; completions' logprobs also scores an echo.
    with _renamed({"prompt_logprobs": "logprobs"}):
        return _parse_completion(fields, limits, tokenizer)


def parse_chat(
    body: object, model_name: str, limits: RequestLimits, tokenizer: Tokenizer
) -> ParsedRequest:
    """A /v1/chat/completions body: messages rendered with the model's chat template."""
    fields = read_body(ChatBody, body, model_name)
    # max_completion_tokens replaced max_tokens in OpenAI's chat API; both are still sent.
    name = "max_completion_tokens" if fields.max_completion_tokens is not None else "max_tokens"
    with _renamed({"logprobs": "top_logprobs", "max_tokens": name}):
        parsed = _parse_chat(fields, limits, tokenizer)
    # the prompt is the one the messages render to
    return dataclasses.replace(parsed, field_names={"prompt": "messages", "max_tokens": name})


@contextlib.contextmanager
def _renamed(names: Mapping[str, str]) -> Iterator[None]:
    """InvalidRequestError from the shared checks -> a 400 naming the field as this endpoint
    calls it."""
    try:
        yield
    except InvalidRequestError as err:
        field = names.get(err.field, err.field)
        message = str(err).removeprefix(f"{err.field}: ")
        raise invalid_request(InvalidRequestError(field, message)) from err


def _parse_completion(
    fields: CompletionBody, limits: RequestLimits, tokenizer: Tokenizer
) -> ParsedRequest:
    if fields.suffix:
        raise bad_field("suffix", f"only '' is supported, got {fields.suffix[:60]!r}")
    if "top_logprobs" in fields.model_fields_set:
        raise bad_field("top_logprobs", "is chat's; completions take logprobs: <count>")
    prompt_ids = _completion_prompt_ids(fields.prompt, limits, tokenizer)
    max_tokens = fields.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens(limits, len(prompt_ids), COMPLETIONS_DEFAULT_MAX_TOKENS)
    # Completions' logprobs is the number of alternatives (0: the sampled token's own only).
    logprobs = fields.logprobs
    echo = None
    if fields.echo:
        prompt = fields.prompt
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
        echo = Echo(text, prompt_ids, prompt_only=max_tokens == 0)
        if echo.prompt_only:
            max_tokens = 1  # the prompt is scored on the way to a first token, not shown
    parsed = _finish(
        fields, prompt_ids, max_tokens, limits, "cmpl", logprobs,
        prompt_logprobs=logprobs if echo is not None else None,
    )  # fmt: skip
    return dataclasses.replace(parsed, echo=echo)


def _parse_chat(fields: ChatBody, limits: RequestLimits, tokenizer: Tokenizer) -> ParsedRequest:
    messages = _messages(fields.messages)
    tools = parse_tools({"tools": fields.tools, "tool_choice": fields.tool_choice})
    try:
        rendered = tokenizer.apply_chat_template(messages, tools=tools.tools if tools else None)
    except InvalidRequestError as err:  # no template, or the template refused the messages
        raise InvalidRequestError("messages", str(err).removeprefix(f"{err.field}: ")) from err
    # The template already placed BOS and the role markers: add nothing more.
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    max_tokens = fields.max_completion_tokens
    if max_tokens is None:
        max_tokens = fields.max_tokens
    grammar = tool_grammar(tools) if tools else None
    if grammar is not None and _grammar(fields) is not None:
        raise bad_field(
            "tool_choice", "a required tool call and a response format exclude each other"
        )
    parsed = _finish(
        fields, prompt_ids, max_tokens, limits, "chatcmpl", _chat_logprobs(fields),
        grammar=grammar,
    )  # fmt: skip
    return dataclasses.replace(parsed, tools=tools)


def _chat_logprobs(fields: ChatBody) -> int | None:
    """Chat's logprobs (true/false) and top_logprobs (a count) -> alternatives, or None."""
    top = fields.top_logprobs
    if not fields.logprobs:
        if top:
            raise bad_field("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def _finish(
    fields: CompletionBody | ChatBody,
    prompt_ids: list[int],
    max_tokens: int | None,
    limits: RequestLimits,
    id_prefix: str,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    grammar: str | None = None,
) -> ParsedRequest:
    stream = fields.stream or False
    if fields.stream_options is not None and not stream:
        raise bad_field("stream_options", "only allowed when stream is true")
    n, best_of = 1 if fields.n is None else fields.n, fields.best_of
    ranked = best_of is not None and best_of > n  # more run than answered: the best are kept
    if ranked and stream:
        raise bad_field("best_of", "cannot be streamed: the best are known only at the end")
    show_logprobs = logprobs is not None
    if ranked and logprobs is None:
        logprobs = 0  # best_of ranks the choices by their sampled tokens' log-probabilities
    generation = build_generation_request(
        prompt_ids,
        limits,
        max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if fields.temperature is None else fields.temperature,
        top_p=1.0 if fields.top_p is None else fields.top_p,
        top_k=fields.top_k or 0,  # vLLM's extension; 0 disables it
        seed=fields.seed,
        stop=_stop_strings(fields.stop),
        stop_token_ids=_token_ids(fields.stop_token_ids, "stop_token_ids", limits),
        ignore_eos=fields.ignore_eos or False,  # vLLM's extension
        request_id=f"{id_prefix}-{uuid.uuid4().hex}",
        resume_token_ids=_token_ids(fields.resume_token_ids, "resume_token_ids", limits),
        logprobs=logprobs,
        penalties=_penalties(fields),
        grammar=grammar or _grammar(fields),
        prompt_logprobs=prompt_logprobs,
        n=n,
        best_of=best_of,
    )
    options = fields.stream_options
    return ParsedRequest(
        generation,
        stream,
        options is not None and options.include_usage,
        fields.return_token_ids or False,
        n=n,
        show_logprobs=show_logprobs,
    )


def _grammar(fields: CompletionBody | ChatBody) -> str | None:
    """response_format (json_object, json_schema), or vLLM's guided_regex / guided_choice."""
    given = [
        name for name in ("guided_regex", "guided_choice") if getattr(fields, name) is not None
    ]
    response_format = fields.response_format
    if response_format is not None and response_format.type != "text":
        given.append("response_format")
    if len(given) > 1:
        raise bad_field(given[1], f"only one of {', '.join(given)} may be set")
    if not given:
        return None
    name = given[0]
    if name == "guided_regex":
        return compile_grammar("regex", fields.guided_regex, name)
    if name == "guided_choice":
        return compile_grammar("choice", fields.guided_choice, name)
    assert response_format is not None
    return _response_format_grammar(response_format)


def _response_format_grammar(response_format: ResponseFormat) -> str:
    name = "response_format"
    if response_format.type == "json_object":
        return compile_grammar("json_object", None, name)
    spec = response_format.json_schema
    if spec is None or not isinstance(spec.get("schema"), dict):
        raise bad_field(name, "json_schema must be an object with a schema object")
    return compile_grammar("json_schema", spec["schema"], name)


def _penalties(fields: CompletionBody | ChatBody) -> Penalties:
    """OpenAI's presence and frequency penalties and logit_bias ({"token id": bias}), vLLM's
    repetition_penalty and min_tokens."""
    logit_bias = {}
    for key, value in (fields.logit_bias or {}).items():
        if not (key.isdigit() and len(key) < 12):
            raise bad_field("logit_bias", f"{key[:60]!r} is not a token id")
        logit_bias[int(key)] = value
    return Penalties(
        presence=fields.presence_penalty or 0.0,
        frequency=fields.frequency_penalty or 0.0,
        repetition=1.0 if fields.repetition_penalty is None else fields.repetition_penalty,
        logit_bias=logit_bias,
        min_tokens=fields.min_tokens or 0,
    )


def _completion_prompt_ids(
    prompt: str | list[int] | list[str] | list[list[int]],
    limits: RequestLimits,
    tokenizer: Tokenizer,
) -> list[int]:
    # OpenAI accepts a string, token ids, or a batch of either; we serve one prompt per request.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(_unicode(prompt, "prompt"))
    if all(isinstance(t, int) for t in prompt):
        ids: list[int] = prompt  # type: ignore[assignment]
        check_prompt_token_ids(ids, limits, field="prompt")
        return list(ids)
    raise bad_field("prompt", f"one prompt per request; got a batch of {len(prompt)}")


def _messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """What the chat template renders: text content, and what tool-aware templates read (an
    assistant's calls, a tool result's call id)."""
    rendered = []
    for i, message in enumerate(messages):
        content = message.content
        if not isinstance(content, str):  # None (only tool calls), or text parts
            content = "".join(part.text for part in content or [])
        kept: dict[str, Any] = {
            "role": message.role,
            "content": _unicode(content, f"messages[{i}].content"),
        }
        if message.tool_calls is not None:
            kept["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            kept["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            kept["name"] = message.name
        rendered.append(kept)
    return rendered


def _unicode(text: str, field: str) -> str:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise bad_field(field, f"is not valid Unicode (a lone surrogate at {err.start})") from err
    return text


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _token_ids(ids: list[int] | None, name: str, limits: RequestLimits) -> list[int]:
    if ids is None:
        return []
    check_prompt_token_ids(ids, limits, field=name)
    return ids
