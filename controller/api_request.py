"""Turning an API request into the engine's request: validation that names the field.

Both public APIs (gRPC `Generate` and the OpenAI-compatible HTTP API) end in
`build_generation_request`, so a request is refused for the same reasons, with the same field
named, whichever door it came through. The bounds themselves live in
controller/scheduler/request_bounds.py; SamplingParams checks the sampling ones.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sarathi_proto import generate_pb2

from controller.engine import GenerationRequest
from controller.grammar import compile_grammar
from controller.scheduler import InvalidRequestError, RequestParams, SamplingParams
from controller.scheduler.request_bounds import MAX_LOGIT_BIAS_TOKENS, MAX_N, check_in
from controller.tool_calls import ToolSpec, parse_tools, tool_grammar


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    """Token ids must be below this."""
    default_max_tokens: int
    max_stop_strings: int
    max_stop_string_chars: int
    eos_token_ids: frozenset[int]
    max_model_len: int | None = None
    """The model's context in tokens: a request that leaves max_tokens unset gets the default
    or what the context leaves after its prompt, whichever is less (vLLM's rule). None: the
    default whatever the prompt."""


def check_prompt_token_ids(
    prompt_ids: Sequence[int], limits: RequestLimits, field: str = "prompt_token_ids"
) -> None:
    """Refuses ids the model has no embedding for (the worker would index out of range)."""
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError(
            field, f"token id {bad[0]} is outside the vocabulary of {limits.vocab_size}"
        )


@dataclass(frozen=True)
class Penalties:
    """The logit adjustments a request asks for (SamplingParams checks their ranges)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0


def build_generation_request(
    prompt_ids: list[int],
    limits: RequestLimits,
    *,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    resume_token_ids: Sequence[int] = (),
    logprobs: int | None = None,
    penalties: Penalties | None = None,
    grammar: str | None = None,
    prompt_logprobs: int | None = None,
    n: int = 1,
    best_of: int | None = None,
) -> GenerationRequest:
    """The checks every API shares; raises InvalidRequestError naming the field. max_tokens None
    means the server's default; seed None draws a fresh one. resume_token_ids: the output a
    client already received, to go on from (the engine and scheduler check that it had not
    ended). logprobs: None, or how many alternatives each token's log-probability comes with.
    grammar: structured output, compiled by controller/grammar.py. n: choices answered;
    best_of: sequences run to pick them from (None: n), OpenAI's."""
    penalties = penalties or Penalties()
    stop_token_ids = tuple(stop_token_ids)
    _check_fields(
        prompt_ids, limits, penalties, stop, resume_token_ids=resume_token_ids, n=n,
        best_of=best_of, max_tokens=max_tokens, stop_token_ids=stop_token_ids,
    )  # fmt: skip
    sampling = _sampling_params(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        logprobs=logprobs,
        penalties=penalties,
        grammar=grammar,
        prompt_logprobs=prompt_logprobs,
    )
    if max_tokens is None:
        max_tokens = default_max_tokens(limits, len(prompt_ids))
    params = _request_params(
        limits,
        sampling,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
    )
    return GenerationRequest(
        request_id or uuid.uuid4().hex,
        prompt_ids,
        params,
        tuple(stop),
        tuple(resume_token_ids),
        n if best_of is None else best_of,
    )


def _check_fields(
    prompt_ids: Sequence[int],
    limits: RequestLimits,
    penalties: Penalties,
    stop: Sequence[str],
    *,
    resume_token_ids: Sequence[int],
    n: int,
    best_of: int | None,
    max_tokens: int | None,
    stop_token_ids: Sequence[int],
) -> None:
    """The field checks made before SamplingParams makes its own. Their order decides which
    field a request with several bad ones is refused for (the same through either API): keep
    it."""
    check_in("n", n, 1, MAX_N)
    if best_of is not None:
        check_in("best_of", best_of, n, MAX_N)
    if (best_of or n) > 1 and resume_token_ids:
        raise InvalidRequestError("resume_token_ids", "resumes one choice: needs n = 1")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError("max_tokens", f"must be >= 1, got {max_tokens}")
    if len(penalties.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError(
            "logit_bias",
            f"{len(penalties.logit_bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} allowed",
        )
    check_prompt_token_ids(list(penalties.logit_bias), limits, field="logit_bias")
    if not prompt_ids:
        raise InvalidRequestError("prompt", "is empty")
    check_prompt_token_ids(resume_token_ids, limits, field="resume_token_ids")
    # The last stage masks stop tokens (min_tokens) by index: one outside the vocabulary would
    # fail its step, and the pipeline with it.
    check_prompt_token_ids(stop_token_ids, limits, field="stop_token_ids")
    _check_stop_strings(stop, limits)


def default_max_tokens(limits: RequestLimits, prompt_len: int, default: int | None = None) -> int:
    """max_tokens for a request that leaves it unset: `default` (the server's when None), or
    what the model's context leaves after the prompt where that is less. A prompt that fills
    the context keeps the default, and the scheduler refuses it, naming the prompt."""
    default = limits.default_max_tokens if default is None else default
    if limits.max_model_len is None or prompt_len >= limits.max_model_len:
        return default
    return min(default, limits.max_model_len - prompt_len)


def _sampling_params(
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    logprobs: int | None,
    penalties: Penalties,
    grammar: str | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    """How each token is drawn. SamplingParams validates temperature, top_p and seed (and the
    penalties), naming them. A request without a seed gets a fresh random one, so that requests
    that set none do not all sample with the same seed."""
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=secrets.randbits(63) if seed is None else seed,
        top_logprobs=logprobs,
        presence_penalty=penalties.presence,
        frequency_penalty=penalties.frequency,
        repetition_penalty=penalties.repetition,
        logit_bias=tuple(sorted(penalties.logit_bias.items())),
        min_tokens=penalties.min_tokens,
        grammar=grammar,
        prompt_logprobs=prompt_logprobs,
    )


def _request_params(
    limits: RequestLimits,
    sampling: SamplingParams,
    *,
    max_tokens: int,
    stop_token_ids: Iterable[int],
    ignore_eos: bool,
) -> RequestParams:
    """When generation ends: the length limit and the stop tokens, which include the model's
    end-of-sequence tokens unless ignore_eos."""
    stop_ids = frozenset(stop_token_ids)
    if not ignore_eos:
        stop_ids |= limits.eos_token_ids
    # Not SamplingParams' check: it never sees max_tokens, which is only settled here.
    if sampling.min_tokens > max_tokens:
        raise InvalidRequestError(
            "min_tokens", f"{sampling.min_tokens} is above max_tokens ({max_tokens})"
        )
    return RequestParams(
        max_tokens=max_tokens,
        stop_token_ids=stop_ids,
        sampling=sampling,
    )


class PromptEncoder(Protocol):
    def __call__(
        self, text: str, apply_chat_template: bool, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """A prompt's token ids: as is, or in the chat template (offered the tools)."""
        ...


def grpc_tools(req: generate_pb2.GenerateRequest) -> ToolSpec | None:
    """GenerateRequest.tools_json and tool_choice; None without tools (or with "none")."""
    if not req.tools_json:
        if req.tool_choice not in ("", "auto", "none"):
            raise InvalidRequestError("tool_choice", "needs tools_json")
        return None
    if not req.apply_chat_template:
        raise InvalidRequestError("tools_json", "needs a text prompt and apply_chat_template")
    try:
        tools = json.loads(req.tools_json)
    except json.JSONDecodeError as err:
        raise InvalidRequestError("tools_json", f"is not JSON: {err}") from err
    choice: object = req.tool_choice or "auto"
    if choice not in ("auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return parse_tools({"tools": tools, "tool_choice": choice})


def _check_stop_strings(stop: Sequence[str], limits: RequestLimits) -> None:
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequestError(
            "stop", f"{len(stop)} stop strings; at most {limits.max_stop_strings} allowed"
        )
    for text in stop:
        if not text:
            raise InvalidRequestError("stop", "a stop string is empty")
        if len(text) > limits.max_stop_string_chars:
            raise InvalidRequestError(
                "stop", f"a stop string is longer than {limits.max_stop_string_chars} characters"
            )


def to_generation_request(
    req: generate_pb2.GenerateRequest,
    limits: RequestLimits,
    encode: PromptEncoder,
    tools: ToolSpec | None = None,
) -> GenerationRequest:
    """Validates and tokenizes; raises InvalidRequestError naming the field. encode tokenizes a
    prompt; tools: grpc_tools(req), offered to the chat template (and their grammar enforced)."""
    if req.prompt and req.prompt_token_ids:
        raise InvalidRequestError("prompt", "set either prompt or prompt_token_ids, not both")
    if req.prompt_token_ids and req.apply_chat_template:
        raise InvalidRequestError("apply_chat_template", "needs a text prompt")
    grammar = grpc_grammar(req) if req.HasField("structured_output") else None
    if tools is not None:
        tool_grammar_ = tool_grammar(tools)
        if tool_grammar_ is not None and grammar is not None:
            raise InvalidRequestError(
                "tool_choice", "a required tool call and structured_output exclude each other"
            )
        grammar = grammar or tool_grammar_
    if req.prompt:
        if tools is None:
            prompt_ids = encode(req.prompt, req.apply_chat_template)
        else:
            prompt_ids = encode(req.prompt, req.apply_chat_template, tools.tools)
    else:
        prompt_ids = list(req.prompt_token_ids)
        check_prompt_token_ids(prompt_ids, limits)
    s = req.sampling
    return build_generation_request(
        prompt_ids,
        limits,
        max_tokens=req.max_tokens or None,  # proto3: 0 means unset
        temperature=s.temperature,
        top_p=s.top_p if s.top_p != 0.0 else 1.0,  # proto3: 0 means unset
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(req.stop),
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        request_id=req.request_id,
        resume_token_ids=req.resume_token_ids,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        penalties=Penalties(
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty or 1.0,  # proto3: 0 means unset
            dict(s.logit_bias),
            s.min_tokens,
        ),
        grammar=grammar,
        prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
        n=req.n or 1,  # proto3: 0 means unset
    )


def grpc_grammar(req: generate_pb2.GenerateRequest) -> str:
    """GenerateRequest.structured_output as an llguidance grammar; refuses a bad one naming
    the field."""
    out, field = req.structured_output, "structured_output"
    kind = out.WhichOneof("kind")
    if kind == "json_schema":
        try:
            schema = json.loads(out.json_schema)
        except json.JSONDecodeError as err:
            raise InvalidRequestError(field, f"json_schema is not JSON: {err}") from err
        return compile_grammar("json_schema", schema, field)
    if kind == "json_object":
        return compile_grammar("json_object", None, field)
    if kind == "regex":
        return compile_grammar("regex", out.regex, field)
    if kind == "choice":
        return compile_grammar("choice", list(out.choice.choices), field)
    raise InvalidRequestError(field, "set one of json_schema, json_object, regex, choice")
