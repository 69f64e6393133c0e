"""The OpenAI HTTP API of a real local cluster fuzzed, as `Generate` is in test_reliability.py:
hypothesis sends valid-ish and garbage JSON bodies (wrong types, huge and non-finite numbers,
lone surrogates, nested junk, missing and unknown fields) with odd headers to /v1/completions,
/v1/chat/completions and /v1/models, and raw sockets send broken HTTP framing. Every answer is a
2xx or an OpenAI-shaped 4xx, never a 5xx nor a hang, and the server serves afterwards. Beyond
statuses: what is accepted generates (every choice asked for, each ended by length or stop),
no accepted request takes a stage down (a NaN in the sampler would), and a json_object answer at
the highest temperature is still JSON (at an infinite one it was garbage with a 200).

Uses test_openai_api.py's cluster fixture (a cluster of its own for this module).
`SARATHI_FUZZ_CASES` sets the case count (default 150).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration import test_openai_api

pytestmark = pytest.mark.integration

served = test_openai_api.served  # the module-scoped cluster fixture, reused
Served = test_openai_api.Served

FUZZ_CASES = int(os.environ.get("SARATHI_FUZZ_CASES", "150"))
TIMEOUT_S = 30  # per answer: a request that takes longer counts as a hang
MODEL = "tiny-llama"  # the fixture's model folder name
ROLES = ["system", "developer", "user", "assistant", "tool"]

# ---- JSON values -----------------------------------------------------------------------------
# Text as JSON can carry it: any code point, lone surrogates included (json.dumps escapes them).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=24)
scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text
)
junk = st.recursive(
    scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=10,
)
token_ids = st.lists(st.integers(-3, 310), max_size=8)
few_tokens = st.integers(1, 6)  # what a real answer may cost: the cases must stay quick

text_part = st.fixed_dictionaries({"type": st.just("text") | junk, "text": any_text | junk})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES) | junk},
    optional={
        "content": any_text | st.lists(text_part, max_size=3) | junk,
        "name": any_text,
    },
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL) | junk,
    "prompt": any_text | token_ids | st.lists(any_text | token_ids, max_size=3) | junk,
    "messages": st.lists(message, max_size=3) | junk,
    "max_tokens": few_tokens | junk,
    "max_completion_tokens": few_tokens | junk,
    "temperature": st.floats(allow_nan=True, allow_infinity=True) | junk,
    "top_p": st.floats(allow_nan=True, allow_infinity=True) | junk,
    "top_k": st.integers(-(2**40), 2**40) | junk,
    "seed": st.integers(-(2**70), 2**70) | junk,
    "stop": any_text | st.lists(any_text, max_size=10) | junk,
    "stop_token_ids": token_ids | junk,
    "stream": st.booleans() | junk,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | junk})
    | junk,
    "ignore_eos": st.booleans() | junk,
    "n": st.sampled_from([1, 2]) | junk,
    "echo": st.booleans() | junk,
    "logprobs": st.booleans() | junk,
    "logit_bias": st.just({}) | junk,
    "response_format": st.just({"type": "text"}) | junk,
    "user": any_text | junk,
}


# Fields of a request the server serves, each with values it accepts.
plain_text = st.text(max_size=24)  # no lone surrogates
VALID_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL),
    "max_tokens": few_tokens,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 2**31 - 1),
    "seed": st.integers(0, 2**64 - 1),
    "stop": plain_text.filter(bool) | st.lists(plain_text.filter(bool), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 299), max_size=3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "n": st.just(1),
    "logit_bias": st.just({}),
    "user": plain_text,
}


@st.composite
def valid_ish_body(draw: st.DrawFn) -> dict[str, Any]:
    """A request the server serves, with at most one field made wrong, and fields nobody
    knows."""
    body = draw(st.fixed_dictionaries({}, optional=VALID_FIELDS))
    body["prompt"] = draw(plain_text | st.lists(st.integers(0, 299), min_size=1, max_size=8))
    body["messages"] = draw(
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(ROLES), "content": plain_text},
                optional={"name": plain_text},
            ),
            min_size=1,
            max_size=3,
        )
    )
    body.setdefault("max_tokens", draw(few_tokens))  # chat's default is 256 tokens: too slow
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(FIELDS)))
        if draw(st.booleans()):
            body[name] = draw(FIELDS[name])
        else:
            body.pop(name, None)
    extra = draw(st.dictionaries(any_text.filter(lambda k: k not in FIELDS), junk, max_size=3))
    return {**extra, **body}


@st.composite
def any_fields_body(draw: st.DrawFn) -> dict[str, Any]:
    """Any of the API's fields, each valid or not, plus fields nobody knows."""
    body = draw(st.fixed_dictionaries({}, optional=FIELDS))
    extra = draw(st.dictionaries(any_text.filter(lambda k: k not in FIELDS), junk, max_size=3))
    return {**extra, **body}


# Bodies no JSON encoder writes.
RAW_BODIES = [
    b"",
    b"{",
    b"null",
    b'{"max_tokens": 1' + b"0" * 5000 + b', "prompt": "a"}',  # past int()'s 4300-digit limit
    b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b".5}",
    b'{"prompt": "a", "max_tokens": 2, "temperature": -Infinity}',
    b"[" * 50_000 + b"]" * 50_000,  # deeper than the parser's recursion limit
    b'{"prompt": ' * 2_000 + b"1" + b"}" * 2_000,
    b'{"prompt": "a", "prompt": [1, 2], "max_tokens": 1}',  # a repeated key: the last wins
    b'\xef\xbb\xbf{"prompt": "a", "max_tokens": 1}',  # a UTF-8 byte order mark
    '{"prompt": "a", "max_tokens": 1}'.encode("utf-16"),
    b'{"prompt": "\xff\xfe", "max_tokens": 1}',  # not UTF-8
    b'{"prompt": "\\ud800\\udbff", "max_tokens": 1}',
    b'{"messages": [{"role": ["user"], "content": "x"}], "max_tokens": 1}',
    b'{"messages": [{"role": {"a": 1}, "content": "x"}], "max_tokens": 1}',
    b'{"prompt": "a", "top_k": 99999999999999999999, "max_tokens": 1}',
    b'{"prompt": "a", "top_k": 2147483648, "max_tokens": 1}',
    b'{"prompt": "a", "seed": 18446744073709551615, "max_tokens": 1}',
    b'{"prompt": "a", "temperature": 1e39, "max_tokens": 2}',
]


def encode(body: object) -> bytes:
    # ensure_ascii: lone surrogates become \\udXXX escapes; allow_nan: NaN and Infinity literals.
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


bodies = (
    valid_ish_body().map(encode)
    | valid_ish_body().map(encode)
    | any_fields_body().map(encode)
    | junk.map(encode)
    | st.sampled_from(RAW_BODIES)
    | st.binary(max_size=64)
)

# ---- headers ---------------------------------------------------------------------------------
# What an HTTP client can send: no control characters, no blank at either end (h11 refuses those).
header_value = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40
).map(lambda text: text.strip().encode("latin-1"))
headers = st.fixed_dictionaries(
    {},
    optional={
        "content-type": st.sampled_from(
            [
                b"application/json",
                b"application/json; charset=utf-16",
                b"text/plain",
                b"application/x-www-form-urlencoded",
                b"multipart/form-data; boundary=x",
                b"",
            ]
        )
        | header_value,
        "authorization": st.sampled_from([b"Bearer", b"Basic Zm9vOmJhcg=="])
        | header_value.map(lambda v: (b"Bearer " + v).strip())
        | header_value,
        "accept": st.sampled_from([b"text/event-stream", b"*/*", b"application/xml"])
        | header_value,
        "x-request-id": header_value,
        "openai-organization": header_value,
    },
)
GENERATE = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]
GENERATE_PATHS = {path for _, path in GENERATE}
# Mostly the generation endpoints; now and then the models list or a wrong method (405).
endpoints = st.one_of(
    st.sampled_from(GENERATE),
    st.sampled_from(GENERATE),
    st.sampled_from(GENERATE),
    st.sampled_from(
        [
            ("GET", "/v1/models"),
            ("GET", "/v1/completions"),
            ("POST", "/v1/models"),
            ("DELETE", "/v1/chat/completions"),
        ]
    ),
)


def assert_openai_answer(response: httpx.Response, sent: bytes = b"") -> None:
    """A 2xx with its body, or a 4xx in OpenAI's error shape. sent: the request's body, to
    check that an accepted generation generated what it asked for."""
    status = response.status_code
    assert status < 500, (status, response.text[:500])
    if status < 300:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n"), response.text[-200:]
            finished = [
                choice["finish_reason"]
                for line in response.text.splitlines()
                if line.startswith("data: {")
                for choice in json.loads(line.removeprefix("data: "))["choices"]
                if choice.get("finish_reason") is not None
            ]
        else:
            body = response.json()
            if body.get("object") == "list":
                return
            finished = [choice["finish_reason"] for choice in body["choices"]]
            if not _sent(sent).get("echo"):  # echo with max_tokens 0 shows the prompt alone
                assert body["usage"]["completion_tokens"] >= len(finished), body
        assert set(finished) <= {"length", "stop", "tool_calls"}, finished
        n = _sent(sent).get("n")
        assert len(finished) == (1 if n is None else n), (sent[:300], finished)
        return
    assert 400 <= status < 500, (status, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]


def _sent(sent: bytes) -> dict[str, Any]:
    """The fields of a body the server accepted."""
    fields: dict[str, Any] = json.loads(sent) if sent else {}
    return fields


def assert_no_stage_went_down(served: Served) -> None:
    """No accepted request broke a worker: a NaN reaching the sampler, a plan the workers
    refuse, would take the pipeline down and show here."""
    log = (served.cluster.log_dir / "controller.log").read_text(errors="replace")
    assert "pipeline down" not in log, log[-3000:]


def assert_serving(served: Served) -> None:
    assert dict(served.cluster.procs)["controller"].poll() is None
    reply = served.client.completions.create(
        model=served.model, prompt="still there", max_tokens=3, temperature=0
    )
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_fuzzed_bodies_and_headers_get_2xx_or_openai_4xx(served: Served) -> None:
    assert served.model == MODEL
    statuses: Counter[int] = Counter()
    refused_fields: Counter[str] = Counter()  # the `param` of each 400
    base = f"http://127.0.0.1:{served.cluster.http_port}"

    with httpx.Client(base_url=base, timeout=TIMEOUT_S) as client:

        @settings(
            max_examples=FUZZ_CASES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(
            endpoint=endpoints,
            body=bodies,
            headers=headers,
            chunked=st.booleans(),
        )
        def one_call(
            endpoint: tuple[str, str], body: bytes, headers: dict[str, bytes], chunked: bool
        ) -> None:
            method, path = endpoint
            # A generator body goes out with Transfer-Encoding: chunked, in two pieces.
            content: Any = iter([body[:7], body[7:]]) if chunked else body
            raw_headers = {name.encode(): value for name, value in headers.items()}
            response = client.request(method, path, content=content, headers=raw_headers)
            statuses[response.status_code] += 1
            assert_openai_answer(response, body if path in GENERATE_PATHS else b"")
            if response.status_code == 400:
                refused_fields[str(response.json()["error"]["param"])] += 1

        one_call()
    print(
        f"\nOpenAI fuzz: {statuses.total()} calls, statuses {dict(sorted(statuses.items()))}, "
        f"400s by field {dict(refused_fields.most_common())}"
    )
    if FUZZ_CASES >= 100:  # enough cases to reach both answers
        assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0
    assert_no_stage_went_down(served)
    assert_serving(served)


def test_bodies_no_encoder_writes_get_2xx_or_openai_4xx(served: Served) -> None:
    """Each of RAW_BODIES to both generation endpoints (hypothesis draws them only now and
    then); a body that broke the engine would show as a hang of every later one."""
    base = f"http://127.0.0.1:{served.cluster.http_port}"
    with httpx.Client(base_url=base, timeout=TIMEOUT_S) as client:
        for method, path in GENERATE:
            for body in RAW_BODIES:
                assert_openai_answer(client.request(method, path, content=body), body)
    assert_no_stage_went_down(served)
    assert_serving(served)


@pytest.mark.parametrize("temperature", [b"1e400", b"Infinity", b"2"])
def test_a_json_object_answer_at_any_accepted_temperature_is_json(
    served: Served, temperature: bytes
) -> None:
    """The issue's request: an infinite temperature divided the grammar mask's -inf logits into
    NaN, and the answer was text that is no JSON, with a 200. Now it is refused; at the
    highest temperature accepted the mask still holds."""
    body = (
        b'{"messages": [{"role": "user", "content": "Name a city"}], "max_tokens": 12, '
        b'"response_format": {"type": "json_object"}, "seed": 3, "temperature": '
        + temperature
        + b"}"
    )
    base = f"http://127.0.0.1:{served.cluster.http_port}"
    response = httpx.post(f"{base}/v1/chat/completions", content=body, timeout=TIMEOUT_S)
    if temperature != b"2":
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "temperature"
        return
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    assert text.startswith("{"), text  # JSON's grammar allows nothing else first
    assert_no_stage_went_down(served)


def raw_request(port: int, head: bytes, body: bytes, wait_s: float = 5.0) -> bytes:
    """Sends bytes as they are, half-closes, and returns what came back (b"" if nothing)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(head + b"\r\n" + body)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                piece = sock.recv(65536)
            except TimeoutError:
                break
            if not piece:
                break
            answer += piece
        return answer


BODY = b'{"prompt": "a", "max_tokens": 1}'


def head(*lines: bytes) -> bytes:
    return b"".join(
        line + b"\r\n" for line in (b"POST /v1/completions HTTP/1.1", b"host: x", *lines)
    )


FRAMINGS = [
    pytest.param(head(b"content-length: -1"), BODY, id="negative length"),
    pytest.param(head(b"content-length: abc"), BODY, id="length not a number"),
    pytest.param(head(b"content-length: 99999999999999999999999"), BODY, id="huge length"),
    # Less than sent: the rest reads as a second, broken request.
    pytest.param(head(b"content-length: 5"), BODY, id="length short"),
    # More than sent, then the client half-closes: the body never completes.
    pytest.param(head(b"content-length: 1000"), BODY, id="length long"),
    pytest.param(head(b"content-length: 3", b"content-length: 4"), BODY, id="two lengths"),
    pytest.param(
        head(b"content-length: 32", b"transfer-encoding: chunked"), BODY, id="length and chunked"
    ),
    pytest.param(
        head(b"transfer-encoding: chunked"), b"zz\r\n" + BODY + b"\r\n0\r\n\r\n", id="bad chunk"
    ),
    pytest.param(head(b"transfer-encoding: gzip"), BODY, id="unknown coding"),
    pytest.param(head(b"content-length: 32", b"content-type: a\x00b"), BODY, id="NUL in header"),
]


@pytest.mark.parametrize(("request_head", "body"), FRAMINGS)
def test_broken_http_framing_is_refused_and_the_server_survives(
    served: Served, request_head: bytes, body: bytes
) -> None:
    log = served.cluster.log_dir / "controller.log"
    logged_before = log.stat().st_size
    answer = raw_request(served.cluster.http_port, request_head, body)
    # The framing errors are answered by uvicorn before the app (plain text, not OpenAI's
    # shape), or the connection is closed: never a 5xx.
    statuses = [int(line.split()[1]) for line in answer.split(b"\r\n") if line.startswith(b"HTTP/")]
    assert all(status < 500 for status in statuses), answer[:500]
    assert_serving(served)
    # A client's broken upload is no server fault: no traceback in the controller's log.
    assert b"Traceback" not in log.read_bytes()[logged_before:]
