"""The OpenAI request bodies as typed models (pydantic, as the OpenAI SDK and vLLM write them).

Each field has its JSON type, strictly: no `true` where a number goes, no 2.0 for an integer, no
NaN or infinity for a number. No bound is here: bounds are the same for gRPC, so the shared
checks hold them (controller/scheduler/request_bounds.py). Fields this server does not know are
kept aside and each name logged once, as vLLM lets them pass. A body that does not fit is a 400
naming the field (`param`), in OpenAI's error shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from controller.openai_api.errors import ApiError, bad_field

logger = logging.getLogger(__name__)

# Names remembered (and logged) at most: a client inventing names must not grow the server's
# memory or its log without end.
MAX_LOGGED_UNKNOWN_FIELDS = 64
_logged_unknown: set[str] = set()


def _described(message: str) -> Callable[[Any, ValidatorFunctionWrapHandler], Any]:
    """A field of several shapes is refused with one message naming them, not one error per
    shape."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("field_shape", message) from None

    return validate


TokenIds = Annotated[list[int], WrapValidator(_described("must be a list of token ids"))]
StopStrings = Annotated[
    str | list[str], WrapValidator(_described("must be a string or a list of strings"))
]
LogitBias = Annotated[
    dict[str, float],
    WrapValidator(_described("must be an object of token id -> finite number")),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    """{"name", "schema", "strict"}: only the schema is read (always enforced)."""


class _RequestBody(_Strict):
    """The fields both endpoints take; those marked "no effect" are OpenAI's, accepted."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's
    seed: int | None = None
    stop: StopStrings | None = None
    stop_token_ids: TokenIds | None = None  # vLLM's
    ignore_eos: bool | None = None  # vLLM's
    min_tokens: int | None = None  # vLLM's
    n: int | None = None
    best_of: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    guided_regex: str | None = None  # vLLM's
    guided_choice: list[str] | None = None  # vLLM's
    resume_token_ids: TokenIds | None = None  # ours: resuming a cut stream
    return_token_ids: bool | None = None  # ours
    user: str | None = None  # no effect
    metadata: dict[str, str] | None = None  # no effect
    store: bool | None = None  # no effect
    service_tier: str | None = None  # no effect
    parallel_tool_calls: bool | None = None  # no effect: calls are read as the model writes them


class CompletionBody(_RequestBody):
    prompt: Annotated[
        str | list[int] | list[str] | list[list[int]],
        WrapValidator(_described("must be a string or a list of token ids")),
    ]
    """Text, token ids, or a batch of one of either."""
    echo: bool | None = None
    logprobs: int | None = None
    """Alternatives per token (0: the sampled token's own log-probability only)."""
    suffix: str | None = None
    """Not supported: only its no-op values ("", null) pass."""
    top_logprobs: Any = None
    """Chat's, refused here whatever its value."""


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[
        str | list[TextPart] | None,
        WrapValidator(_described("must be a string or a list of text parts (text only)")),
    ] = None
    """None: an assistant turn that only called tools."""
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatBody(_RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    """What replaced max_tokens in OpenAI's chat API; either is read."""
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    """Checked by controller/tool_calls.py, as gRPC's tools_json."""
    tool_choice: Annotated[
        str | dict[str, Any] | None,
        WrapValidator(_described("must be none, auto, required or a named function")),
    ] = None


Body = TypeVar("Body", bound=_RequestBody)


def read_body(kind: type[Body], body: object, model_name: str) -> Body:
    """The body as `kind`; raises ApiError: 400 naming the field, 404 for another model."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        fields = kind.model_validate(body)
    except ValidationError as err:
        raise _field_error(err.errors(include_url=False)[0]) from None
    if fields.model is not None and fields.model != model_name:
        raise ApiError(
            404,
            f"model: {fields.model!r} is not served here; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )
    _log_unknown_fields(fields.model_extra or {})
    return fields


_EXPECTED = {
    "int_type": "must be an integer",
    "float_type": "must be a finite number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "missing": "is required",
    "too_short": "must not be empty",
}


def _field_error(error: ErrorDetails) -> ApiError:
    """A 400 naming the field as a client wrote it: messages[0].role, stream_options."""
    param = "".join(
        f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
    ).lstrip(".")
    kind = error["type"]
    if kind == "literal_error":
        message = f"must be {error.get('ctx', {}).get('expected', 'one of the allowed values')}"
    else:
        message = _EXPECTED.get(kind, error["msg"])
    given = error.get("input")
    if kind != "missing" and not isinstance(given, dict | list):
        message += f", got {_short(repr(given))}"
    return bad_field(param, message)


def _short(text: str, max_chars: int = 60) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _log_unknown_fields(extra: dict[str, Any]) -> None:
    """Fields this server does not know pass, as vLLM lets them, but each name is logged once so
    an operator sees what clients send that has no effect."""
    for name in extra.keys() - _logged_unknown:
        if len(_logged_unknown) >= MAX_LOGGED_UNKNOWN_FIELDS:
            return
        _logged_unknown.add(name)
        logger.warning("request field %r is not supported and was ignored", name[:100])
