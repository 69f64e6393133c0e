"""Tool calls (chat and gRPC): the request's tools checked field by field, the grammar that holds
`required` and a named function, and calls read back out of the text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer
from sarathi_proto import generate_pb2

from controller.api_request import grpc_tools
from controller.openai_api.errors import ApiError
from controller.scheduler import InvalidRequestError
from controller.tool_calls import ToolSpec, parse_tool_calls, parse_tools, tool_grammar
from tests.unit.test_openai_requests import chat
from tests.unit.test_tokenizer import make_backend

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_tools(fields)
    assert err.value.field == param


def test_none_and_no_tools_mean_plain_chat_and_auto_has_no_grammar() -> None:
    assert parse_tools({}) is None
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    auto = parse_tools({"tools": [WEATHER]})
    assert auto is not None and auto.choice == "auto" and tool_grammar(auto) is None
    assert auto.schemas()["get_weather"]["required"] == ["city"]
    no_parameters = parse_tools({"tools": [TIME]})
    assert no_parameters is not None and no_parameters.schemas()["get_time"]["type"] == "object"


def matcher(spec: ToolSpec) -> tuple[LLMatcher, LLTokenizer]:
    grammar = tool_grammar(spec)
    assert grammar is not None
    tokenizer = LLTokenizer(make_backend().to_str())
    return LLMatcher(tokenizer, grammar), tokenizer


def test_required_and_named_grammars_take_only_valid_calls() -> None:
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert required is not None
    m, tok = matcher(required)
    assert m.consume_tokens(tok.tokenize_str(call)) and m.is_accepting()
    m, tok = matcher(required)
    assert not m.consume_tokens(tok.tokenize_str("Sure! " + call))  # a call, nothing else
    choice = {"type": "function", "function": {"name": "get_time"}}
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": choice})
    assert named is not None
    m, tok = matcher(named)
    assert not m.consume_tokens(tok.tokenize_str(call))  # not the named function
    bad_city = call.replace("Paris", "a city name far too long")
    m, tok = matcher(required)
    assert not m.consume_tokens(tok.tokenize_str(bad_city))  # its schema holds


def test_calls_are_read_out_of_the_text_in_openais_shape() -> None:
    spec = parse_tools({"tools": [WEATHER]})
    assert spec is not None
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text, spec)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert content is not None and content.startswith("Let me check.")
    assert "unknown" in content  # a block naming no tool of the request stays text
    assert parse_tool_calls("no calls here", spec) == ("no calls here", [])


def test_chat_with_a_required_tool_gets_its_grammar_and_excludes_a_response_format() -> None:
    parsed = chat(tools=[WEATHER], tool_choice="required")
    assert parsed.tools is not None and parsed.generation.params.sampling.grammar
    assert chat(tools=[WEATHER]).generation.params.sampling.grammar is None  # auto
    with pytest.raises(ApiError) as err:
        chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert err.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools_json": "[", "apply_chat_template": True}, "tools_json"),
        ({"tools_json": "[]", "apply_chat_template": False}, "tools_json"),
        (
            {
                "tools_json": json.dumps([WEATHER]),
                "apply_chat_template": True,
                "tool_choice": "nope",
            },
            "tool_choice",
        ),
    ],
)
def test_grpc_tools_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        grpc_tools(generate_pb2.GenerateRequest(prompt="hi", **fields))
    assert err.value.field == param


def test_grpc_tools_take_openai_tools_and_a_choice_by_name() -> None:
    request = generate_pb2.GenerateRequest(
        prompt="hi", apply_chat_template=True, tools_json=json.dumps([WEATHER]),
        tool_choice="get_weather",
    )  # fmt: skip
    spec = grpc_tools(request)
    assert spec is not None and spec.choice == "get_weather"
    assert grpc_tools(generate_pb2.GenerateRequest(prompt="hi")) is None
