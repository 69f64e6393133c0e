"""Structured output: what a request constrains its output to, compiled to an llguidance grammar
that the last stage enforces with a token mask before every sampled token.

The controller compiles and checks the grammar (a bad schema or regex is refused here, naming
the field); the last stage runs the matcher: it has the logits, so no mask ever crosses the
network, and at PP > 1 no stage waits for one. The grammar text travels once, with the
sequence's sampling parameters.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Literal

from llguidance import LLMatcher

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from controller.scheduler import InvalidRequestError

Kind = Literal["json_object", "json_schema", "regex", "choice"]

JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
"""JSON as json.dumps writes it: no free whitespace between tokens, which a model (a small one
above all) could otherwise write until max_tokens, leaving JSON that never closes."""


def compile_grammar(kind: Kind, spec: object, field: str) -> str:
    """The llguidance grammar of one constraint; raises InvalidRequestError naming `field`.
    spec: None (json_object), a JSON schema object (json_schema), a regex string (regex) or a
    list of strings (choice)."""
    if kind == "json_object":
        grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    elif kind == "json_schema":
        if not isinstance(spec, dict):
            raise InvalidRequestError(field, "the JSON schema must be an object")
        try:
            grammar = LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)
        except ValueError as err:
            raise InvalidRequestError(field, f"not a usable JSON schema: {err}") from err
    elif kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidRequestError(field, "the regex must be a non-empty string")
        grammar = LLMatcher.grammar_from_regex(spec)
    else:
        if not (isinstance(spec, list) and spec and all(isinstance(c, str) and c for c in spec)):
            raise InvalidRequestError(field, "the choices must be a list of non-empty strings")
        # Lark string literals take JSON's escapes: any text is one exact alternative.
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec)))
    problem = check(grammar)
    if problem:
        raise InvalidRequestError(field, problem)
    return grammar


def check(grammar: str) -> str:
    """Empty if llguidance accepts the grammar, else its first error line."""
    try:
        message = LLMatcher.validate_grammar(grammar)
    except ValueError as err:
        message = str(err)
    return message.strip().splitlines()[0] if message.strip() else ""
