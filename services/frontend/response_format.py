"""OpenAI `response_format` (chat and completions, as vLLM accepts it) -> a `Grammar`.

    {"type": "text"}                                         free text (the default)
    {"type": "json_object"}                                  any JSON object
    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}, "strict": true}}

Only the shape is checked here; whether the schema compiles is `grammar_check.py`'s job
(off the event loop). `strict` is accepted either way: the output always follows the schema.
"""

from __future__ import annotations

import json

from services.frontend.validation import quote
from shared.errors import InvalidArgumentError
from shared.grammar import Grammar, GrammarKind

_TYPES = ("text", "json_object", "json_schema")


def parse_response_format(value: object) -> Grammar | None:
    """The grammar `value` (a request's response_format) asks for; None for free text."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgumentError("response_format must be an object such as {\"type\": \"json_object\"}")
    kind = value.get("type")
    if kind not in _TYPES:
        shown = quote(kind) if isinstance(kind, str) else "missing" if kind is None else "not a string"
        raise InvalidArgumentError(f"response_format.type {shown} is not supported; use one of {', '.join(_TYPES)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgumentError("response_format.json_schema must be an object with a \"schema\" "
                                   "(type json_schema)")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError("response_format.json_schema.name must be a string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidArgumentError("response_format.json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidArgumentError("response_format.json_schema.schema is required and must be a JSON schema "
                                   "object")
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))
