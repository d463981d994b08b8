"""OpenAI `response_format` (chat and completions, as vLLM accepts it) -> a `Grammar`.

    {"type": "text"}                                         free text (the default)
    {"type": "json_object"}                                  any JSON object
    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}, "strict": true}}

Only the shape is checked here; whether the schema compiles is `grammar_check.py`'s job
(off the event loop). `strict` is accepted either way: the output always follows the schema.

vLLM's extra field `structured_outputs` is accepted too, for clients moving from vLLM:
exactly one of {"json": schema, "json_object": true, "regex": "...", "choice": [...],
"grammar": "<Lark>"}; with a response_format other than text it is a conflict (400).
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


_EXTRA_FORMS = ("json", "json_object", "regex", "choice", "grammar")


def parse_structured_outputs(value: object) -> Grammar | None:
    """vLLM's `structured_outputs` extra field as a Grammar; None when absent or empty."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgumentError("structured_outputs must be an object such as {\"regex\": \"[a-z]+\"}")
    given = [form for form in _EXTRA_FORMS if value.get(form) not in (None, False)]
    if len(given) > 1:
        raise InvalidArgumentError(f"structured_outputs sets {' and '.join(given)}; set only one")
    if not given:
        return None
    form, spec = given[0], value[given[0]]
    if form == "json_object":
        return Grammar.json_object()
    if form == "json":
        if isinstance(spec, str):
            return Grammar(GrammarKind.JSON_SCHEMA, spec)
        if not isinstance(spec, dict):
            raise InvalidArgumentError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(spec, ensure_ascii=False))
    if form == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise InvalidArgumentError("structured_outputs.choice must be a non-empty list of non-empty strings")
        return Grammar(GrammarKind.LARK, "start: " + " | ".join(json.dumps(c) for c in spec))
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"structured_outputs.{form} must be a string")
    return Grammar(GrammarKind.REGEX if form == "regex" else GrammarKind.LARK, spec)


def parse_grammar(response_format: object, structured_outputs: object) -> Grammar | None:
    """The request's grammar from either field; both set is a conflict."""
    from_format, from_extra = parse_response_format(response_format), parse_structured_outputs(structured_outputs)
    if from_format is not None and from_extra is not None:
        raise InvalidArgumentError("response_format and structured_outputs both constrain the output; send one")
    return from_format or from_extra
