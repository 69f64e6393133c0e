"""Turning a GenerateRequest into the engine's request: validation that names the field."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sarathi_proto import generate_pb2

from controller.engine import GenerationRequest
from controller.scheduler import InvalidRequestError, RequestParams, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    """Token ids must be below this."""
    default_max_tokens: int
    max_stop_strings: int
    max_stop_string_chars: int
    eos_token_ids: frozenset[int]


def to_generation_request(
    req: generate_pb2.GenerateRequest,
    limits: RequestLimits,
    encode: Callable[[str, bool], list[int]],
) -> GenerationRequest:
    """Validates and tokenizes; raises InvalidRequestError naming the field. encode(text,
    apply_chat_template) tokenizes a prompt."""
    if req.prompt and req.prompt_token_ids:
        raise InvalidRequestError("prompt", "set either prompt or prompt_token_ids, not both")
    if req.prompt_token_ids and req.apply_chat_template:
        raise InvalidRequestError("apply_chat_template", "needs a text prompt")
    if req.prompt:
        prompt_ids = encode(req.prompt, req.apply_chat_template)
    else:
        prompt_ids = list(req.prompt_token_ids)
        bad = [t for t in prompt_ids if t >= limits.vocab_size]
        if bad:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"token id {bad[0]} is outside the vocabulary of {limits.vocab_size}",
            )
    if not prompt_ids:
        raise InvalidRequestError("prompt", "is empty")
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidRequestError(
            "stop", f"{len(req.stop)} stop strings; at most {limits.max_stop_strings} allowed"
        )
    for stop in req.stop:
        if not stop:
            raise InvalidRequestError("stop", "a stop string is empty")
        if len(stop) > limits.max_stop_string_chars:
            raise InvalidRequestError(
                "stop", f"a stop string is longer than {limits.max_stop_string_chars} characters"
            )
    s = req.sampling
    if s.top_k < 0:
        raise InvalidRequestError("top_k", f"must be >= 0, got {s.top_k}")
    sampling = SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p if s.top_p != 0.0 else 1.0,  # proto3: 0 means unset
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else secrets.randbits(63),
    )
    stop_ids = frozenset(req.stop_token_ids)
    if not req.ignore_eos:
        stop_ids |= limits.eos_token_ids
    params = RequestParams(
        max_tokens=req.max_tokens or limits.default_max_tokens,
        stop_token_ids=stop_ids,
        sampling=sampling,
    )
    request_id = req.request_id or uuid.uuid4().hex
    return GenerationRequest(request_id, prompt_ids, params, tuple(req.stop))
