"""What tests/integration/test_openai_fuzz.py found, pinned without processes: bodies that got a
500 (or, for top_k, stopped the engine for every later request) now get a 400 naming the field,
and invented field names cannot grow the server's memory or log without end. Then semantics, not
only statuses: whatever sampling numbers a body carries, an accepted request reaches the
workers' plan with every float finite and in its bounds (NaN or infinity never reaches the
sampler), and a refused one names a field it sent."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from controller.executor.plan_codec import encode_sampling
from controller.openai_api import bodies
from controller.openai_api.errors import ApiError
from controller.openai_api.routes import build_app
from controller.scheduler.batch import TokenHistory
from controller.scheduler.request_bounds import MAX_TEMPERATURE
from tests.unit.test_openai_app import ScriptedEngine, make_state
from tests.unit.test_openai_requests import chat, completion


def refused(parse: Any, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(**fields)
    assert err.value.status_code == 400
    return err.value


@pytest.mark.parametrize("prompt", ["\ud800", "ok \udfff", ["\udbff"]])
def test_a_lone_surrogate_in_the_prompt_is_400(prompt: object) -> None:
    # JSON's "\ud800" escape decodes to a lone surrogate; the tokenizer raised TypeError (500).
    assert refused(completion, prompt=prompt).param == "prompt"


@pytest.mark.parametrize(
    "content", ["\ud800", [{"type": "text", "text": "a"}, {"type": "text", "text": "\udc00"}]]
)
def test_a_lone_surrogate_in_a_message_is_400(content: object) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": content}]
    assert refused(chat, messages=messages).param == "messages[1].content"


@pytest.mark.parametrize("role", [["user"], {"user": 1}])
def test_an_unhashable_role_is_400(role: object) -> None:
    # `role not in CHAT_ROLES` raised TypeError on a list or an object (500).
    error = refused(chat, messages=[{"role": role, "content": "hi"}])
    assert error.param == "messages[0].role"


def test_top_k_past_int32_is_400_and_int32_max_is_accepted() -> None:
    # 2**31 reached the workers' int32 field: encoding the plan raised in the engine's loop, and
    # no request was served again (the HTTP API has no int32 bound of its own, unlike gRPC).
    error = refused(completion, top_k=2**31)
    assert error.param == "top_k" and str(2**31 - 1) in error.message
    assert refused(completion, top_k=10**30).param == "top_k"
    assert completion(top_k=2**31 - 1).generation.params.sampling.top_k == 2**31 - 1


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",  # past int()'s digit limit
        b"[" * 100_000 + b"]" * 100_000,  # past the parser's recursion limit
        b'{"prompt": ' * 5_000 + b"1" + b"}" * 5_000,
    ],
    ids=["5000-digit number", "deep array", "deep object"],
)
def test_json_the_parser_cannot_hold_is_400_in_openai_shape(body: bytes) -> None:
    client = TestClient(build_app(make_state(ScriptedEngine())), raise_server_exceptions=False)
    response = client.post("/v1/completions", content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("the request body is not valid JSON")


def test_invented_field_names_are_logged_and_kept_only_up_to_a_bound(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bodies, "_logged_unknown", set())
    with caplog.at_level(logging.WARNING, logger="controller.openai_api.bodies"):
        for i in range(500):
            completion(max_tokens=2, **{f"invented_{i}": 1, "x" * 10_000: 2})
    assert len(caplog.records) == bodies.MAX_LOGGED_UNKNOWN_FIELDS
    assert len(bodies._logged_unknown) == bodies.MAX_LOGGED_UNKNOWN_FIELDS
    assert max(len(r.getMessage()) for r in caplog.records) < 200  # long names cut short


def test_a_client_gone_before_its_body_is_whole_is_no_server_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A Content-Length larger than what came, then the connection closed: Starlette raised
    # ClientDisconnect, answered 500 to nobody and logged two tracebacks per such request.
    app = build_app(make_state(ScriptedEngine()))
    incoming: list[dict[str, Any]] = [
        {"type": "http.request", "body": b'{"prompt": "a"', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "root_path": "", "query_string": b"", "headers": [(b"content-length", b"1000")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    with caplog.at_level(logging.ERROR):
        asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400


# ---- semantics: what is accepted reaches the workers finite and bounded --------------------
wide_number = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, 2, 2.0000001, -2, 100, 1e400, -0.0])
)
FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty"]
sampling_fields = st.fixed_dictionaries(
    {},
    optional={
        **{name: wide_number for name in FLOAT_FIELDS},
        "repetition_penalty": wide_number,
        "logit_bias": st.dictionaries(st.sampled_from(["1", "7", "42"]), wide_number, max_size=3),
        "top_k": st.integers(-5, 2**40),
        "response_format": st.just({"type": "json_object"}),
    },
)


def planned_floats(parsed: Any) -> list[float]:
    """Every float of the sampling parameters as the workers' plan carries them (float32)."""
    sampling = parsed.generation.params.sampling
    history = TokenHistory([1, 2], [], frozenset()) if sampling.needs_history else None
    wire = encode_sampling(sampling, history)
    return [
        wire.temperature, wire.top_p, wire.presence_penalty, wire.frequency_penalty,
        wire.repetition_penalty, *wire.logit_bias_values,
    ]  # fmt: skip


@settings(max_examples=300, deadline=None, database=None)
@given(fields=sampling_fields, endpoint=st.sampled_from([completion, chat]))
def test_every_accepted_float_reaches_the_plan_finite_and_in_bounds(
    fields: dict[str, Any], endpoint: Any
) -> None:
    try:
        parsed = endpoint(max_tokens=2, **fields)
    except ApiError as err:
        assert err.status_code == 400 and err.param in {*fields, "logit_bias"}, err.message
        return
    sampling = parsed.generation.params.sampling
    assert 0 <= sampling.temperature <= MAX_TEMPERATURE
    assert 0 < sampling.top_p <= 1
    assert all(math.isfinite(value) for value in planned_floats(parsed))
    for name in FLOAT_FIELDS:  # accepted as sent, not clamped
        if name in fields and fields[name] is not None:
            assert getattr(sampling, name) == fields[name]
