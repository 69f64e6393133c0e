"""Tool calls, for the chat API and gRPC alike: the request's `tools` and `tool_choice`, the
grammar that makes `required` and a named function certain, and the calls read back out of the
model's text.

Calls are written the way Hermes-style templates (Qwen2.5, Hermes, SmolLM3 and others) teach
models to: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
With `auto` the model decides and its text is parsed; with `required` or a named function the
last stage's grammar mask (controller/grammar.py's machinery) allows nothing but such blocks,
their arguments valid under the function's JSON schema, so the call always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from controller.grammar import JSON_DEFAULTS, check
from controller.scheduler import InvalidRequestError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolSpec:
    tools: list[dict[str, Any]]
    """The request's tools, as the chat template takes them ({"type": "function", ...})."""
    choice: str
    """"auto", "required", or the name of the function that must be called."""

    def schemas(self) -> dict[str, dict[str, Any]]:
        """Function name -> its parameters' JSON schema."""
        return {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}


def parse_tools(fields: Mapping[str, Any]) -> ToolSpec | None:
    """`tools` and `tool_choice`; None when there are none or the choice is "none"."""
    tools = fields.get("tools")
    choice = fields.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", "must be a list of function tools")
    checked = [_tool(t, i) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools", "two tools have the same name")
    if choice is None or choice == "auto":
        return ToolSpec(checked, "auto")
    if choice == "none":
        return None
    if choice == "required":
        return ToolSpec(checked, "required")
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if not isinstance(name, str) or name not in names:
            raise InvalidRequestError("tool_choice", f"names no tool of this request: {name!r}")
        return ToolSpec(checked, name)
    raise InvalidRequestError(
        "tool_choice", 'must be "none", "auto", "required" or a named function'
    )


def _tool(tool: object, index: int) -> dict[str, Any]:
    field = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(field, 'must be {"type": "function", "function": {...}}')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{field}.function", "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"{field}.function.name", "must be 1-64 of a-z, A-Z, 0-9, _ and -"
        )
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{field}.function.parameters", "must be a JSON schema object")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise InvalidRequestError(f"{field}.function.description", "must be a string")
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def tool_grammar(spec: ToolSpec) -> str | None:
    """The grammar `required` and a named function are held to (None for `auto`): one or more
    call blocks, each a {"name", "arguments"} object valid for one of the allowed functions."""
    if spec.choice == "auto":
        return None
    schemas = spec.schemas()
    if spec.choice != "required":
        schemas = {spec.choice: schemas[spec.choice]}
    call_schema = {
        "x-guidance": JSON_DEFAULTS,
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, parameters in schemas.items()
        ],
    }
    lark = (
        f'start: call ("\\n" call)*\ncall: {json.dumps(CALL_OPEN + chr(10))} body '
        f"{json.dumps(chr(10) + CALL_CLOSE)}\nbody: %json {json.dumps(call_schema)}"
    )
    grammar = LLMatcher.grammar_from_lark(lark)
    problem = check(grammar)
    if problem:
        raise InvalidRequestError(
            "tools", f"a function's parameters are not a usable JSON schema: {problem}"
        )
    return grammar


def parse_tool_calls(text: str, spec: ToolSpec) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside call blocks or None, the calls in OpenAI's shape). A block that is not
    a {"name", "arguments"} object naming one of the request's tools stays text."""
    names = spec.schemas()
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(call, dict) and call.get("name") in names):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False),
                },
            }
        )
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls
