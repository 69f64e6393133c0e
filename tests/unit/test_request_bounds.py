"""Every float of a request is finite and bounded, on both APIs, with the bound read from one
place (controller/scheduler/request_bounds.py): a temperature of 1e400 or Infinity used to be
accepted, and divided the grammar mask's -inf logits into NaN, so a json_object answer came back
as garbage with a 200."""

from __future__ import annotations

import math
from typing import Any

import pytest
from sarathi_proto import generate_pb2
from starlette.testclient import TestClient

from controller.api_request import to_generation_request
from controller.openai_api.errors import ApiError
from controller.openai_api.routes import build_app
from controller.scheduler import InvalidRequestError
from controller.scheduler.request_bounds import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
)
from tests.unit.test_openai_app import ScriptedEngine, make_state
from tests.unit.test_openai_requests import chat, completion, make_limits
from tests.unit.test_tokenizer import make_tokenizer

NOT_FINITE = [math.inf, -math.inf, math.nan, 1e400]
# Each float field of the OpenAI bodies, with its largest accepted value and one past it.
FLOATS: dict[str, tuple[float, float]] = {
    "temperature": (MAX_TEMPERATURE, MAX_TEMPERATURE + 0.01),
    "top_p": (1.0, 1.01),
    "presence_penalty": (MAX_ABS_PENALTY, MAX_ABS_PENALTY + 0.01),
    "frequency_penalty": (MAX_ABS_PENALTY, MAX_ABS_PENALTY + 0.01),
    "repetition_penalty": (MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY + 0.01),
}


def refused_field(parse: Any, **fields: Any) -> str:
    with pytest.raises(ApiError) as err:
        parse(**fields)
    assert err.value.status_code == 400
    assert err.value.message.startswith(f"{err.value.param}: ")
    return str(err.value.param)


@pytest.mark.parametrize("value", NOT_FINITE, ids=["inf", "-inf", "nan", "1e400"])
@pytest.mark.parametrize("name", sorted(FLOATS))
def test_a_float_that_is_not_finite_is_400_naming_it(name: str, value: float) -> None:
    assert refused_field(completion, **{name: value}) == name
    assert refused_field(chat, **{name: value}) == name


@pytest.mark.parametrize("value", NOT_FINITE, ids=["inf", "-inf", "nan", "1e400"])
def test_a_logit_bias_that_is_not_finite_is_400(value: float) -> None:
    assert refused_field(completion, logit_bias={"5": value}) == "logit_bias"


@pytest.mark.parametrize("name", sorted(FLOATS))
def test_each_float_is_bounded_and_its_bound_itself_is_accepted(name: str) -> None:
    largest, past = FLOATS[name]
    assert getattr(completion(**{name: largest}).generation.params.sampling, name) == largest
    assert refused_field(completion, **{name: past}) == name
    assert refused_field(chat, **{name: past}) == name


def test_logit_bias_is_bounded_at_100() -> None:
    bias = completion(logit_bias={"5": -MAX_ABS_LOGIT_BIAS}).generation.params.sampling
    assert bias.logit_bias == ((5, -100.0),)
    assert refused_field(completion, logit_bias={"5": MAX_ABS_LOGIT_BIAS + 0.5}) == "logit_bias"


@pytest.mark.parametrize(
    "literal", [b"1e400", b"Infinity", b"-Infinity", b"NaN", b"2.5"], ids=lambda b: b.decode()
)
def test_the_chat_temperature_of_the_issue_is_400_through_http(literal: bytes) -> None:
    # Python's json reads 1e400 as inf and takes the Infinity and NaN literals.
    engine = ScriptedEngine()
    client = TestClient(build_app(make_state(engine)), raise_server_exceptions=False)
    body = (
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
        b'"response_format": {"type": "json_object"}, "temperature": ' + literal + b"}"
    )
    response = client.post("/v1/chat/completions", content=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "temperature"
    assert engine.added == []  # nothing reached the engine, let alone the sampler


GRPC_FLOATS = ["temperature", "top_p", "presence_penalty", "frequency_penalty"]


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e400, 3.0])
@pytest.mark.parametrize("name", [*GRPC_FLOATS, "repetition_penalty"])
def test_grpc_refuses_the_same_floats_naming_the_field(name: str, value: float) -> None:
    sampling = generate_pb2.SamplingParams(**{name: value})
    request = generate_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling=sampling)
    with pytest.raises(InvalidRequestError) as err:
        to_generation_request(request, make_limits(make_tokenizer()), lambda t, c: [1])
    assert err.value.field == name


@pytest.mark.parametrize("value", [math.inf, math.nan, 101.0])
def test_grpc_refuses_a_logit_bias_that_is_not_finite_or_too_large(value: float) -> None:
    sampling = generate_pb2.SamplingParams(logit_bias={3: value})
    request = generate_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling=sampling)
    with pytest.raises(InvalidRequestError) as err:
        to_generation_request(request, make_limits(make_tokenizer()), lambda t, c: [1])
    assert err.value.field == "logit_bias"


@pytest.mark.parametrize(
    ("http_fields", "sampling"),
    [
        ({"temperature": 2.5}, generate_pb2.SamplingParams(temperature=2.5)),
        ({"repetition_penalty": 4.0}, generate_pb2.SamplingParams(repetition_penalty=4.0)),
        ({"logit_bias": {"3": 101}}, generate_pb2.SamplingParams(logit_bias={3: 101})),
    ],
)
def test_http_and_grpc_refuse_a_float_past_its_bound_with_the_same_message(
    http_fields: dict[str, Any], sampling: generate_pb2.SamplingParams
) -> None:
    request = generate_pb2.GenerateRequest(prompt="the", sampling=sampling)
    tokenizer = make_tokenizer()
    with pytest.raises(InvalidRequestError) as grpc_err:
        to_generation_request(request, make_limits(tokenizer), tokenizer.encode_prompt)
    with pytest.raises(ApiError) as http_err:
        completion(prompt="the", **http_fields)
    assert http_err.value.message == str(grpc_err.value)


NUMBER_FIELDS = [
    *FLOATS, "max_tokens", "top_k", "seed", "n", "best_of", "min_tokens", "logprobs",
]  # fmt: skip


@pytest.mark.parametrize("name", NUMBER_FIELDS)
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_no_number(name: str, value: bool) -> None:
    # Python's bool is an int: `true` used to pass some hand-written int checks as 1.
    assert refused_field(completion, **{name: value}) == name


def test_an_integer_field_refuses_a_float_even_a_whole_one() -> None:
    assert refused_field(completion, max_tokens=2.0) == "max_tokens"
    assert refused_field(chat, n=1.0) == "n"


def test_logit_bias_refuses_a_boolean_bias() -> None:
    assert refused_field(completion, logit_bias={"5": True}) == "logit_bias"
