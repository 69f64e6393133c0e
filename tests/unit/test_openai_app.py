"""The HTTP app in-process (no sockets) against a scripted engine: the JSON and SSE a client
sees, OpenAI-shaped errors with their statuses, the 401/429 hooks, and that a client going away
aborts its sequence."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.testclient import TestClient

from controller.admission import PipelineDownError, QueueFullError
from controller.engine import GenerationRequest, RequestHandle, StreamEvent
from controller.logprobs import TokenLogprobs
from controller.openai_api.routes import build_app
from controller.openai_api.state import HttpApiState
from controller.scheduler import FinishReason, InvalidRequestError
from tests.unit.test_openai_requests import MODEL, make_limits
from tests.unit.test_tokenizer import make_tokenizer


class NoText:
    def push(self, token_id: int) -> tuple[str, bool]:
        return "", False

    def finish(self) -> str:
        return ""


@dataclass
class ScriptedEngine:
    """Every request streams `deltas`; the last one ends it with `finish` unless that is None
    (a request that runs until aborted)."""

    deltas: Sequence[str] = ("Hel", "lo", " world")
    finish: FinishReason | None = FinishReason.LENGTH
    added: list[GenerationRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    handles: dict[str, RequestHandle] = field(default_factory=dict)

    def add(self, request: GenerationRequest) -> RequestHandle:
        """Choice c of n streams `deltas`, token t with log-probability
        -0.5 * (t + 1) - (n - 1 - c): the last choice is the likeliest."""
        self.added.append(request)
        handle = RequestHandle(request.request_id, 0.0, request.n)
        asked = request.params.sampling.top_logprobs is not None
        for i, text in enumerate(self.deltas):
            last = i == len(self.deltas) - 1 and self.finish is not None
            for choice in range(request.n):
                logprob = -0.5 * (i + 1) - (request.n - 1 - choice)
                handle.events.put_nowait(
                    StreamEvent(
                        text,
                        [i],
                        self.finish if last else None,
                        num_prompt_tokens=len(request.prompt_token_ids),
                        num_output_tokens=len(self.deltas),
                        logprobs=TokenLogprobs(logprob, (i, 7), (-0.5, -2.0)) if asked else None,
                        choice=choice,
                    )
                )
        handle.num_finished = request.n if self.finish is not None else 0
        self.handles[request.request_id] = handle
        return handle

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        handle = self.handles[request_id]
        for choice in range(handle.num_finished, handle.n):
            handle.events.put_nowait(StreamEvent("", [], FinishReason.ABORT, choice=choice))
        handle.num_finished = handle.n
        return True


def make_state(engine: ScriptedEngine | None = None, **hooks: Any) -> HttpApiState:
    state = HttpApiState(MODEL, **hooks)
    if engine is not None:
        tokenizer = make_tokenizer()
        state.attach(engine, make_limits(tokenizer), tokenizer)
    return state


def sse_bodies(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    lines = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_health_is_503_until_the_pipeline_serves() -> None:
    state = make_state()
    client = TestClient(build_app(state))
    down = client.get("/health")
    assert down.status_code == 503
    assert down.json()["error"]["code"] == "not_ready"
    state.attach(ScriptedEngine(), make_limits(make_tokenizer()), make_tokenizer())
    assert client.get("/health").status_code == 200


def test_generation_is_503_in_openai_shape_while_not_ready() -> None:
    response = TestClient(build_app(make_state())).post(
        "/v1/completions", json={"model": MODEL, "prompt": "the"}
    )
    assert response.status_code == 503
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_models_lists_the_served_model() -> None:
    body = TestClient(build_app(make_state(ScriptedEngine()))).get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]


def test_non_streamed_completion_has_the_whole_text_and_usage() -> None:
    engine = ScriptedEngine()
    response = TestClient(build_app(make_state(engine))).post(
        "/v1/completions", json={"model": MODEL, "prompt": "the Paris", "max_tokens": 3}
    )
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == "Hello world"
    assert body["choices"][0]["finish_reason"] == "length"
    num_prompt = len(engine.added[0].prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 3,
        "total_tokens": num_prompt + 3,
    }
    assert body["id"] == engine.added[0].request_id  # gRPC Abort can name it


def test_non_streamed_chat_answers_as_the_assistant() -> None:
    engine = ScriptedEngine(finish=FinishReason.STOP)
    body = (
        TestClient(build_app(make_state(engine)))
        .post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        .json()
    )
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_streamed_chat_names_the_speaker_then_deltas_then_usage_then_done() -> None:
    engine = ScriptedEngine()
    response = TestClient(build_app(make_state(engine))).post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_bodies(response.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_streamed_completion_without_usage_has_no_usage_field() -> None:
    response = TestClient(build_app(make_state(ScriptedEngine()))).post(
        "/v1/completions", json={"prompt": "the", "stream": True}
    )
    chunks = sse_bodies(response.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    ],
)
def test_a_bad_n_or_best_of_is_a_400_naming_it_and_queues_nothing(
    path: str, fields: dict[str, object], param: str
) -> None:
    engine = ScriptedEngine()
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **fields}
    response = TestClient(build_app(make_state(engine))).post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert engine.added == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_choices_each_with_its_index_and_usage_counting_them_all(path: str) -> None:
    engine = ScriptedEngine()
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "n": 3}
    answer = TestClient(build_app(make_state(engine))).post(path, json=body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    texts = [c.get("text") or c["message"]["content"] for c in answer["choices"]]
    assert texts == ["Hello world"] * 3
    assert answer["usage"]["completion_tokens"] == 3 * 3
    assert answer["usage"]["prompt_tokens"] == len(engine.added[0].prompt_token_ids)
    assert engine.added[0].n == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_streamed_choices_each_end_with_their_own_finish_then_done(path: str) -> None:
    engine = ScriptedEngine()
    body = {
        "prompt": "hi",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = TestClient(build_app(make_state(engine))).post(path, json=body)
    chunks = sse_bodies(response.text)
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index[choice["index"]].append(choice)
    for choices in by_index.values():
        text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
        assert text == "Hello world"
        assert [c["finish_reason"] for c in choices].count("length") == 1
        assert choices[-1]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_best_of_answers_the_likeliest_and_hides_the_logprobs_it_ranked_by() -> None:
    engine = ScriptedEngine()
    body = {"prompt": "hi", "n": 2, "best_of": 4}
    answer = TestClient(build_app(make_state(engine))).post("/v1/completions", json=body).json()
    assert engine.added[0].n == 4
    assert engine.added[0].params.sampling.top_logprobs == 0  # asked for, to rank
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 4 * 3  # every sequence run counts


def test_best_of_picks_by_summed_logprobs() -> None:
    engine = ScriptedEngine()
    body = {"prompt": "hi", "n": 1, "best_of": 3, "logprobs": 0}
    answer = TestClient(build_app(make_state(engine))).post("/v1/completions", json=body).json()
    (choice,) = answer["choices"]
    # The last choice is the likeliest: its tokens are -0.5, -1.0, -1.5 (choice 0's -2.5 ...).
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -1.0, -1.5]


def test_a_body_that_is_not_json_is_a_400() -> None:
    response = TestClient(build_app(make_state(ScriptedEngine()))).post(
        "/v1/completions", content=b"{not json"
    )
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]


def test_unknown_paths_answer_404_in_openai_shape() -> None:
    response = TestClient(build_app(make_state(ScriptedEngine()))).get("/v1/embeddings")
    assert response.status_code == 404
    assert "/v1/embeddings" in response.json()["error"]["message"]


def test_authentication_hook_refuses_a_missing_or_wrong_bearer_token() -> None:
    engine = ScriptedEngine()
    client = TestClient(build_app(make_state(engine, api_keys=frozenset({"sk-right"}))))
    body = {"prompt": "the"}
    assert client.post("/v1/completions", json=body).status_code == 401
    wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-x"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models").status_code == 401
    assert engine.added == []
    right = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-right"})
    assert right.status_code == 200


def test_admission_hook_answers_429_and_queues_nothing() -> None:
    engine = ScriptedEngine()
    state = make_state(engine, queue_full=lambda: True, retry_after_s=2.5)
    response = TestClient(build_app(state)).post("/v1/completions", json={"prompt": "the"})
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "queue_full"
    assert response.headers["retry-after"] == "3"  # whole seconds, rounded up
    assert engine.added == []


@pytest.mark.parametrize(
    ("refusal", "status", "code"),
    [(QueueFullError("full; retry in 4 s", 4.0), 429, "queue_full"),
     (PipelineDownError("a stage is down", 0.5), 503, "not_ready")],
)  # fmt: skip
def test_an_engine_refusal_carries_its_retry_hint_as_retry_after(
    refusal: QueueFullError | PipelineDownError, status: int, code: str
) -> None:
    """What OpenAI's SDKs wait before retrying: the admission config's hint, as gRPC sends it
    in trailing metadata."""

    class Refusing(ScriptedEngine):
        def add(self, request: GenerationRequest) -> RequestHandle:
            raise refusal

    response = TestClient(build_app(make_state(Refusing()))).post(
        "/v1/completions", json={"prompt": "the"}
    )
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert response.headers["retry-after"] == str(math.ceil(refusal.retry_after_s))


async def call_and_disconnect(app: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Drives the ASGI app like a server whose client hangs up once the first body part (or
    nothing, for a non-streamed request) has been sent."""
    sent: list[dict[str, Any]] = []
    hang_up = asyncio.Event()
    request_read = False

    async def receive() -> dict[str, Any]:
        nonlocal request_read
        if not request_read:
            request_read = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            hang_up.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    task = asyncio.create_task(app(scope, receive, send))
    if not body.get("stream"):
        await asyncio.sleep(0.05)  # the request is queued and waiting for its answer
        hang_up.set()
    await asyncio.wait_for(task, 5)
    return sent


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_aborts_its_sequence(stream: bool) -> None:
    engine = ScriptedEngine(deltas=("a",), finish=None)  # would run until aborted
    app = build_app(make_state(engine))
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
    asyncio.run(call_and_disconnect(app, body))
    assert engine.aborted == [engine.added[0].request_id]


def test_http_port_outside_the_tcp_range_is_refused_naming_the_field() -> None:
    from controller.config import ServerConfig
    from controller.scheduler import ConfigError

    with pytest.raises(ConfigError) as err:
        ServerConfig(http_port=70000)
    assert err.value.field == "http_port"
    assert ServerConfig().http_port == 0  # off unless asked for


def test_return_token_ids_gives_every_id_and_the_seed_for_a_resume() -> None:
    # The middle delta's text is held back (empty): its id must still reach the client.
    engine = ScriptedEngine(deltas=("Hel", "", "lo"))
    response = TestClient(build_app(make_state(engine))).post(
        "/v1/completions",
        json={"prompt": "the", "stream": True, "return_token_ids": True, "temperature": 0.8},
    )
    chunks = sse_bodies(response.text)
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert ids == [0, 1, 2]
    assert {c["seed"] for c in chunks} == {engine.added[0].params.sampling.seed}
    whole = TestClient(build_app(make_state(engine))).post(
        "/v1/completions", json={"prompt": "the", "return_token_ids": True, "seed": 7}
    )
    assert whole.json()["choices"][0]["token_ids"] == [0, 1, 2]
    assert whole.json()["seed"] == 7


def test_without_return_token_ids_the_answer_is_plain_openai() -> None:
    response = TestClient(build_app(make_state(ScriptedEngine()))).post(
        "/v1/completions", json={"prompt": "the", "stream": True}
    )
    for body in sse_bodies(response.text):
        assert "seed" not in body and "token_ids" not in body["choices"][0]


def test_resume_token_ids_reach_the_engine_and_are_checked() -> None:
    engine = ScriptedEngine()
    client = TestClient(build_app(make_state(engine)))
    ok = client.post("/v1/completions", json={"prompt": "the", "resume_token_ids": [3, 4]})
    assert ok.status_code == 200
    assert engine.added[0].resume_token_ids == (3, 4)
    bad = client.post("/v1/completions", json={"prompt": "the", "resume_token_ids": [10**9]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "resume_token_ids"


def test_completion_logprobs_come_in_the_legacy_columns_streamed_or_whole() -> None:
    tokenizer = make_tokenizer()
    engine = ScriptedEngine(deltas=("Hel", "", "lo"))  # the middle token's text is held back
    client = TestClient(build_app(make_state(engine)))
    whole = client.post("/v1/completions", json={"prompt": "the", "logprobs": 2}).json()
    logprobs = whole["choices"][0]["logprobs"]
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in (0, 1, 2)]
    assert logprobs["tokens"] == texts
    assert logprobs["token_logprobs"] == [-0.5, -1.0, -1.5]
    seven = tokenizer.decode([7], skip_special_tokens=False)
    assert logprobs["top_logprobs"][1] == {texts[1]: -0.5, seven: -2.0}
    assert logprobs["text_offset"] == [0, len(texts[0]), len(texts[0]) + len(texts[1])]
    streamed = client.post("/v1/completions", json={"prompt": "the", "logprobs": 2, "stream": True})
    chunks = [c for c in sse_bodies(streamed.text) if c["choices"][0]["logprobs"]]
    assert [c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks] == [
        [-0.5],
        [-1.0],
        [-1.5],
    ]  # fmt: skip  (every token, the held-back one too)
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [
        [0], [len(texts[0])], [len(texts[0]) + len(texts[1])],
    ]  # fmt: skip


def test_chat_logprobs_are_content_entries_with_bytes_and_alternatives() -> None:
    engine = ScriptedEngine()
    body = (
        TestClient(build_app(make_state(engine)))
        .post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "logprobs": True,
                "top_logprobs": 2,
            },
        )
        .json()
    )
    content = body["choices"][0]["logprobs"]["content"]
    assert [entry["logprob"] for entry in content] == [-0.5, -1.0, -1.5]
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in content)
    assert [len(entry["top_logprobs"]) for entry in content] == [2, 2, 2]
    assert content[0]["top_logprobs"][1]["logprob"] == -2.0
    assert engine.added[0].params.sampling.top_logprobs == 2


def test_without_logprobs_the_choice_logprobs_is_null() -> None:
    body = TestClient(build_app(make_state(ScriptedEngine()))).post(
        "/v1/completions", json={"prompt": "the"}
    )
    assert body.json()["choices"][0]["logprobs"] is None


def test_a_body_over_the_limit_is_a_413_and_queues_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from controller.openai_api import routes

    monkeypatch.setattr(routes, "MAX_BODY_BYTES", 1024)
    engine = ScriptedEngine()
    client = TestClient(build_app(make_state(engine)))
    big = json.dumps({"prompt": "x" * 2000})
    declared = client.post(
        "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert declared.status_code == 413 and set(declared.json()["error"]) >= {"message", "type"}

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it streams in
        for _ in range(5):
            yield b" " * 400

    streamed = client.post("/v1/completions", content=chunks())
    assert streamed.status_code == 413
    assert engine.added == []


def test_each_choice_s_text_offsets_start_at_its_own_text_streamed_or_whole() -> None:
    """Completions' text_offset counts into the choice's own text: with n > 1 every choice's
    start at 0, also when their chunks interleave in a stream."""
    client = TestClient(build_app(make_state(ScriptedEngine())))
    body = {"prompt": "the", "n": 2, "logprobs": 0}
    whole = client.post("/v1/completions", json=body).json()
    offsets = [c["logprobs"]["text_offset"] for c in whole["choices"]]
    assert offsets[0] == offsets[1] and offsets[0][0] == 0
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    by_choice: dict[int, list[int]] = {0: [], 1: []}
    for c in sse_bodies(streamed.text):
        for choice in c["choices"]:
            if choice["logprobs"]:
                by_choice[choice["index"]] += choice["logprobs"]["text_offset"]
    assert by_choice[0] == by_choice[1] == offsets[0]


def test_a_streamed_chat_with_tools_carries_the_logprobs_and_token_ids_of_the_whole() -> None:
    """With tools the answer's text is held to be read for tool calls, and goes as one chunk:
    that chunk carries every token's id and log-probability, as the unstreamed answer does."""
    tool = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
        "logprobs": True,
        "return_token_ids": True,
    }
    client = TestClient(build_app(make_state(ScriptedEngine())))
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    (content,) = [c["choices"][0] for c in sse_bodies(streamed.text) if c["choices"][0]["logprobs"]]
    assert content["token_ids"] == whole["token_ids"] == [0, 1, 2]
    assert content["logprobs"] == whole["logprobs"]
    assert content["delta"]["content"] == whole["message"]["content"] == "Hello world"


@dataclass
class RefusingEngine(ScriptedEngine):
    """Refuses every request as the scheduler does one past the model's context."""

    def add(self, request: GenerationRequest) -> RequestHandle:
        raise InvalidRequestError("max_tokens", "prompt plus max_tokens is beyond the context")


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_the_scheduler_s_refusal_names_the_field_as_the_request_did(name: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], name: 100}
    response = TestClient(build_app(make_state(RefusingEngine()))).post(
        "/v1/chat/completions", json=body
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == name
    assert response.json()["error"]["message"].startswith(f"{name}: prompt plus max_tokens")
