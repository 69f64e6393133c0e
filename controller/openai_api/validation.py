"""OpenAI request bodies -> the engine's GenerationRequest, refusing what we cannot honour.

Field types and OpenAI-only fields are checked here; everything the gRPC API also has (prompt,
max_tokens, sampling, stop strings) goes through controller/api_request.py's shared checks, so
both APIs refuse a request for the same reason and name the same field. Fields we do not
implement are accepted only at their no-op value (`n=1`, `echo=false`, ...): silently ignoring
`n=2` would hand back fewer choices than asked for.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller.api_request import (
    MAX_N,
    Penalties,
    RequestLimits,
    build_generation_request,
    check_prompt_token_ids,
)
from controller.engine import GenerationRequest
from controller.grammar import compile_grammar
from controller.openai_api.errors import ApiError, bad_field, invalid_request
from controller.scheduler import InvalidRequestError
from controller.scheduler.sequence import MAX_TOP_LOGPROBS
from controller.tokenizer import Tokenizer
from controller.tool_calls import ToolSpec, parse_tools, tool_grammar

logger = logging.getLogger(__name__)

# OpenAI's own default: sampling, not greedy (send temperature=0 for greedy).
DEFAULT_TEMPERATURE = 1.0
# OpenAI's (and vLLM's) default for /v1/completions; chat gets the server's --default-max-tokens.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# top_k travels to the workers as an int32 (gRPC's own field is one).
TOP_K_MAX = 2**31 - 1

# Field -> the values that mean "not used", the only ones accepted.
_NO_OP_VALUES: dict[str, tuple[object, ...]] = {
    "suffix": (None, ""),
}


# Fields read here, and OpenAI's that change nothing for this server (user, metadata, ...).
_KNOWN_FIELDS = frozenset(
    {
        *_NO_OP_VALUES, "logprobs", "top_logprobs", "model", "prompt", "messages", "max_tokens",
        "max_completion_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "min_tokens", "echo", "tools", "tool_choice", "response_format",
        "guided_regex", "guided_choice",
        "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
        "stream_options", "ignore_eos", "user", "metadata", "store", "service_tier",
        "parallel_tool_calls", "resume_token_ids", "return_token_ids", "n", "best_of",
    }
)  # fmt: skip
_logged_unknown: set[str] = set()
# Names remembered (and logged) at most: a client inventing names must not grow the server's
# memory or its log without end.
MAX_LOGGED_UNKNOWN_FIELDS = 64


def _log_unknown_fields(body: Mapping[str, Any]) -> None:
    """Fields this server does not know pass, as vLLM lets them, but each name is logged once so
    an operator sees what clients send that has no effect."""
    for name in body.keys() - _KNOWN_FIELDS - _logged_unknown:
        if len(_logged_unknown) >= MAX_LOGGED_UNKNOWN_FIELDS:
            return
        _logged_unknown.add(name)
        logger.warning("request field %r is not supported and was ignored", name[:100])


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
    try:
        return _parse_completion(body, model_name, limits, tokenizer)
    except InvalidRequestError as err:  # the shared checks of controller/api_request.py
        raise invalid_request(err) from err


def parse_chat(
    body: object, model_name: str, limits: RequestLimits, tokenizer: Tokenizer
) -> ParsedRequest:
    """A /v1/chat/completions body: messages rendered with the model's chat template."""
    try:
        return _parse_chat(body, model_name, limits, tokenizer)
    except InvalidRequestError as err:
        raise invalid_request(err) from err


def _parse_completion(
    body: object, model_name: str, limits: RequestLimits, tokenizer: Tokenizer
) -> ParsedRequest:
    fields = _common_checks(body, model_name)
    prompt_ids = _completion_prompt_ids(fields.get("prompt"), limits, tokenizer)
    max_tokens = _optional_int(fields, "max_tokens")
    if max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    # Completions' logprobs is the number of alternatives (0: the sampled token's own only).
    logprobs = _optional_int(fields, "logprobs")
    if "top_logprobs" in fields:
        raise bad_field("top_logprobs", "is chat's; completions take logprobs: <count>")
    echo = None
    if _optional_bool(fields, "echo"):
        prompt = fields.get("prompt")
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
        echo = Echo(text, prompt_ids, prompt_only=max_tokens == 0)
        if echo.prompt_only:
            max_tokens = 1  # the prompt is scored on the way to a first token, not shown
    parsed = _finish(
        fields, prompt_ids, "max_tokens", max_tokens, limits, "cmpl", logprobs,
        prompt_logprobs=logprobs if echo is not None else None,
    )  # fmt: skip
    return dataclasses.replace(parsed, echo=echo)


def _parse_chat(
    body: object, model_name: str, limits: RequestLimits, tokenizer: Tokenizer
) -> ParsedRequest:
    fields = _common_checks(body, model_name)
    messages = _messages(fields.get("messages"))
    tools = parse_tools(fields)
    try:
        rendered = tokenizer.apply_chat_template(messages, tools=tools.tools if tools else None)
    except InvalidRequestError as err:  # no template, or the template refused the messages
        raise InvalidRequestError("messages", str(err).removeprefix(f"{err.field}: ")) from err
    # The template already placed BOS and the role markers: add nothing more.
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    # max_completion_tokens replaced max_tokens in OpenAI's chat API; both are still sent.
    name = "max_tokens"
    if fields.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    max_tokens = _optional_int(fields, name)
    grammar = tool_grammar(tools) if tools else None
    if grammar is not None and _grammar(fields) is not None:
        raise bad_field(
            "tool_choice", "a required tool call and a response format exclude each other"
        )
    parsed = _finish(
        fields, prompt_ids, name, max_tokens, limits, "chatcmpl", _chat_logprobs(fields),
        grammar=grammar,
    )  # fmt: skip
    return dataclasses.replace(parsed, tools=tools)


def _chat_logprobs(fields: Mapping[str, Any]) -> int | None:
    """Chat's logprobs (true/false) and top_logprobs (a count) -> alternatives, or None."""
    top = _optional_int(fields, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_field("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    if not _optional_bool(fields, "logprobs"):
        if top:
            raise bad_field("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def _common_checks(body: object, model_name: str) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404,
            f"model: {model!r} is not served here; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )
    for name, allowed in _NO_OP_VALUES.items():
        if name in body and body[name] not in allowed:
            shown = " or ".join(repr(v) for v in allowed if v is not None)
            raise bad_field(name, f"only {shown} is supported, got {body[name]!r}")
    _log_unknown_fields(body)
    return body


def _finish(
    fields: Mapping[str, Any],
    prompt_ids: list[int],
    max_tokens_field: str,
    max_tokens: int | None,
    limits: RequestLimits,
    id_prefix: str,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    grammar: str | None = None,
) -> ParsedRequest:
    if max_tokens is not None and max_tokens < 1:
        raise bad_field(max_tokens_field, f"must be >= 1, got {max_tokens}")
    stream = _optional_bool(fields, "stream") or False
    include_usage = _include_usage(fields.get("stream_options"), stream)
    temperature = _optional_float(fields, "temperature")
    top_p = _optional_float(fields, "top_p")
    top_k = _optional_int(fields, "top_k") or 0  # vLLM's extension; 0 disables it
    if top_k > TOP_K_MAX:  # JSON has no int32 bound; the workers' plans do
        raise bad_field("top_k", f"must be at most {TOP_K_MAX}, got {top_k}")
    n, best_of = _choices(fields, stream)
    show_logprobs = logprobs is not None
    if best_of > n and logprobs is None:
        logprobs = 0  # best_of ranks the choices by their sampled tokens' log-probabilities
    generation = build_generation_request(
        prompt_ids,
        limits,
        max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k,
        seed=_optional_int(fields, "seed"),
        stop=_stop_strings(fields.get("stop")),
        stop_token_ids=_token_ids(fields, "stop_token_ids", limits),
        ignore_eos=_optional_bool(fields, "ignore_eos") or False,  # vLLM's extension
        request_id=f"{id_prefix}-{uuid.uuid4().hex}",
        resume_token_ids=_token_ids(fields, "resume_token_ids", limits),  # our extension
        logprobs=logprobs,
        penalties=_penalties(fields),
        grammar=grammar or _grammar(fields),
        prompt_logprobs=prompt_logprobs,
        n=best_of,
    )
    return_token_ids = _optional_bool(fields, "return_token_ids") or False
    return ParsedRequest(
        generation,
        stream,
        include_usage,
        return_token_ids,
        n=n,
        show_logprobs=show_logprobs,
    )


def _choices(fields: Mapping[str, Any], stream: bool) -> tuple[int, int]:
    """(n, best_of): choices answered, and sequences run to pick them from."""
    n = _optional_int(fields, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad_field("n", f"must be in [1, {MAX_N}], got {n}")
    best_of = _optional_int(fields, "best_of")
    if best_of is None:
        return n, n
    if not n <= best_of <= MAX_N:
        raise bad_field("best_of", f"must be in [n, {MAX_N}] (n is {n}), got {best_of}")
    if best_of > n and stream:
        raise bad_field("best_of", "cannot be streamed: the best are known only at the end")
    return n, best_of


def _grammar(fields: Mapping[str, Any]) -> str | None:
    """response_format (json_object, json_schema), or vLLM's guided_regex / guided_choice."""
    given = [name for name in ("guided_regex", "guided_choice") if fields.get(name) is not None]
    response_format = fields.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise bad_field("response_format", "must be an object with a type")
        kind = response_format.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise bad_field("response_format", "type must be text, json_object or json_schema")
        if kind != "text":
            given.append("response_format")
    if len(given) > 1:
        raise bad_field(given[1], f"only one of {', '.join(given)} may be set")
    if not given:
        return None
    name = given[0]
    if name == "guided_regex":
        return compile_grammar("regex", fields["guided_regex"], name)
    if name == "guided_choice":
        return compile_grammar("choice", fields["guided_choice"], name)
    assert isinstance(response_format, dict)
    if response_format["type"] == "json_object":
        return compile_grammar("json_object", None, name)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_field(name, "json_schema must be an object with a schema object")
    return compile_grammar("json_schema", spec["schema"], name)


def _penalties(fields: Mapping[str, Any]) -> Penalties:
    """OpenAI's presence and frequency penalties and logit_bias ({"token id": bias}), vLLM's
    repetition_penalty and min_tokens."""
    bias = fields.get("logit_bias")
    if bias is None:
        bias = {}
    if not isinstance(bias, dict):
        raise bad_field("logit_bias", "must be an object of token id -> bias")
    logit_bias = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 12):
            raise bad_field("logit_bias", f"{key!r} is not a token id")
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise bad_field("logit_bias", f"the bias of {key} must be a number, got {value!r}")
        logit_bias[int(key)] = float(value)
    repetition = _optional_float(fields, "repetition_penalty")
    return Penalties(
        presence=_optional_float(fields, "presence_penalty") or 0.0,
        frequency=_optional_float(fields, "frequency_penalty") or 0.0,
        repetition=1.0 if repetition is None else repetition,
        logit_bias=logit_bias,
        min_tokens=_optional_int(fields, "min_tokens") or 0,
    )


def _completion_prompt_ids(
    prompt: object, limits: RequestLimits, tokenizer: Tokenizer
) -> list[int]:
    # OpenAI accepts a string, token ids, or a batch of either; we serve one prompt per request.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(_unicode(prompt, "prompt"))
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        check_prompt_token_ids(prompt, limits, field="prompt")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad_field("prompt", f"one prompt per request; got a batch of {len(prompt)}")
    raise bad_field("prompt", "must be a string or a list of token ids")


def _messages(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_field("messages", "must be a non-empty list of {role, content} objects")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_field(f"messages[{i}]", "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_field(f"messages[{i}].role", f"must be one of {sorted(CHAT_ROLES)}")
        content = _unicode(_content(message.get("content"), i), f"messages[{i}].content")
        kept: dict[str, Any] = {"role": role, "content": content}
        # What tool-aware templates render: an assistant's calls, a tool result's call id.
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise bad_field(f"messages[{i}].tool_calls", "must be a list")
            kept["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                kept[key] = message[key]
        messages.append(kept)
    return messages


def _unicode(text: str, field: str) -> str:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise bad_field(field, f"is not valid Unicode (a lone surrogate at {err.start})") from err
    return text


def _content(content: object, index: int) -> str:
    if content is None:  # an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones for a text model
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_field(f"messages[{index}].content", "only text parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_field(f"messages[{index}].content", "a text part needs a string text")
            texts.append(text)
        return "".join(texts)
    raise bad_field(f"messages[{index}].content", "must be a string or a list of text parts")


def _include_usage(options: object, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_field("stream_options", "only allowed when stream is true")
    if not isinstance(options, dict):
        raise bad_field("stream_options", "must be an object")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_field("stream_options.include_usage", "must be true or false")
    return include


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise bad_field("stop", "must be a string or a list of strings")


def _token_ids(fields: Mapping[str, Any], name: str, limits: RequestLimits) -> list[int]:
    value = fields.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise bad_field(name, "must be a list of token ids")
    check_prompt_token_ids(value, limits, field=name)
    return list(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(fields: Mapping[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is None or _is_int(value):
        return value
    raise bad_field(name, f"must be an integer, got {value!r}")


def _optional_float(fields: Mapping[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise bad_field(name, f"must be a number, got {value!r}")


def _optional_bool(fields: Mapping[str, Any], name: str) -> bool | None:
    value = fields.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise bad_field(name, f"must be true or false, got {value!r}")
