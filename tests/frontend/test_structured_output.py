"""Structured output in the frontend: response_format parsing, the gRPC `structured` field, and
early grammar validation (a 400 for an invalid, too large or too slow grammar; results cached).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.frontend.grammar_check import GrammarChecker
from services.frontend.response_format import parse_grammar, parse_response_format, parse_structured_outputs
from services.frontend.wire import grammar_from_proto
from shared.errors import InvalidArgumentError
from shared.grammar import MAX_GRAMMAR_CHARS, Grammar, GrammarKind
from shared.pb.spindle.v1 import generation_pb2 as pb

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _checker(tokenizer_dir: Path, **kwargs: float) -> GrammarChecker:
    async def inline(fn):  # noqa: ANN001, ANN202 - stands in for the tokenizer's thread
        return fn()

    return GrammarChecker(AutoTokenizer.from_pretrained(tokenizer_dir), inline, **kwargs)


def test_response_format_forms() -> None:
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == Grammar.json_object()
    grammar = parse_response_format({"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert grammar is not None and grammar.kind is GrammarKind.JSON_SCHEMA and json.loads(grammar.spec) == SCHEMA


@pytest.mark.parametrize(("value", "message"), [
    ("json", "response_format must be an object"),
    ({"type": "yaml"}, "response_format.type 'yaml' is not supported"),
    ({}, "response_format.type missing"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}, "strict must be a boolean"),
])
def test_bad_response_format_is_a_clear_error(value: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_response_format(value)


def test_vllm_structured_outputs_forms() -> None:
    assert parse_structured_outputs(None) is None and parse_structured_outputs({}) is None
    assert parse_structured_outputs({"regex": "a+"}) == Grammar(GrammarKind.REGEX, "a+")
    assert parse_structured_outputs({"json": SCHEMA}).kind is GrammarKind.JSON_SCHEMA
    assert parse_structured_outputs({"json": '{"type": "object"}'}).spec == '{"type": "object"}'
    assert parse_structured_outputs({"json_object": True}) == Grammar.json_object()
    assert parse_structured_outputs({"choice": ["a", "b c"]}) == Grammar(GrammarKind.LARK, 'start: "a" | "b c"')
    assert parse_structured_outputs({"grammar": 'start: "x"'}) == Grammar(GrammarKind.LARK, 'start: "x"')
    for bad, message in [({"regex": "a", "choice": ["b"]}, "set only one"), ({"choice": []}, "non-empty list"),
                         ({"regex": 5}, "regex must be a string"), ([1], "must be an object")]:
        with pytest.raises(InvalidArgumentError, match=message):
            parse_structured_outputs(bad)
    with pytest.raises(InvalidArgumentError, match="send one"):
        parse_grammar({"type": "json_object"}, {"regex": "a"})
    assert parse_grammar({"type": "text"}, {"regex": "a"}) == Grammar(GrammarKind.REGEX, "a")


def test_grpc_structured_forms() -> None:
    assert grammar_from_proto(pb.StructuredOutput()) is None
    assert grammar_from_proto(pb.StructuredOutput(json_object=True)) == Grammar.json_object()
    assert grammar_from_proto(pb.StructuredOutput(regex="a+")) == Grammar(GrammarKind.REGEX, "a+")
    assert grammar_from_proto(pb.StructuredOutput(lark="start: \"x\"")) == Grammar(GrammarKind.LARK, "start: \"x\"")


async def test_checker_accepts_valid_refuses_invalid_and_caches(tokenizer_dir: Path) -> None:
    checker = _checker(tokenizer_dir)
    await checker.check(Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    await checker.check(Grammar(GrammarKind.REGEX, "[0-9]+"))
    await checker.check(parse_structured_outputs({"choice": ["yes", "no way", "ünï"]}))
    bad = [Grammar(GrammarKind.JSON_SCHEMA, '{"type": "frob"}'), Grammar(GrammarKind.JSON_SCHEMA, "{not json"),
           Grammar(GrammarKind.REGEX, "(unclosed"), Grammar(GrammarKind.LARK, "start: missing_rule"),
           Grammar(GrammarKind.REGEX, "a" * (MAX_GRAMMAR_CHARS + 1))]
    for grammar in bad:
        with pytest.raises(InvalidArgumentError):
            await checker.check(grammar)
    # Cached: the same bad spec is refused again without compiling (the pool is not used).
    checker._pool.shutdown()
    with pytest.raises(InvalidArgumentError, match="frob"):
        await checker.check(bad[0])


async def test_a_slow_compilation_is_refused_after_the_time_limit(tokenizer_dir: Path) -> None:
    checker = _checker(tokenizer_dir, timeout_s=0.05)
    slow = Grammar(GrammarKind.REGEX, "x")
    checker._compile = lambda grammar: time.sleep(0.5) or ""  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="longer than 0.05 s"):
        await asyncio.gather(checker.check(slow))
    assert time.monotonic() - started < 0.4
