"""Structured output: a request's grammar and its binding to the grammar engine (llguidance).

Why llguidance: it is one small wheel with no dependencies (xgrammar pulls triton and its
bundled CUDA tools into a CPU install), computes a token mask in microseconds, and takes
JSON schema, regex and Lark grammars through one matcher type.

The frontend compiles a grammar once to validate it (400 on a bad one); the worker compiles
it again (cached by spec) and keeps one matcher per request. Both sides use `compile_grammar`
here, so what the frontend accepts is exactly what the worker can run. Only the spec (kind +
text) crosses the services: compiled grammars are tied to a tokenizer and are not portable.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import llguidance

from shared.errors import InvalidArgumentError

# Largest grammar spec (schema JSON, regex or Lark text) a request may carry, in characters.
MAX_GRAMMAR_CHARS = 64 * 1024
# Compact JSON: a random or weak model otherwise pads with whitespace until max_tokens.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# Bounds llguidance's own work per grammar build and per mask step (a hostile grammar is cut off).
_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_grammar_size=100_000,
               max_lexer_states=50_000, verbose_errors=False)


class GrammarKind(enum.StrEnum):
    """How `Grammar.spec` is written."""

    JSON_SCHEMA = "json_schema"  # a JSON schema document (json_object is {"type": "object"})
    REGEX = "regex"  # the whole output fully matches it
    LARK = "lark"  # a Lark context-free grammar (llguidance's dialect)


@dataclass(slots=True, frozen=True)
class Grammar:
    """What the output must match; hashable, so compiled forms are cached by it."""

    kind: GrammarKind
    spec: str

    @staticmethod
    def json_object() -> Grammar:
        return Grammar(GrammarKind.JSON_SCHEMA, '{"type": "object"}')


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**_LIMITS)


def engine_grammar(grammar: Grammar) -> str:
    """The llguidance grammar text for `grammar`; InvalidArgumentError when it cannot be one."""
    if len(grammar.spec) > MAX_GRAMMAR_CHARS:
        raise InvalidArgumentError(f"the {grammar.kind.value} is too large: {len(grammar.spec)} characters, more "
                                   f"than the limit of {MAX_GRAMMAR_CHARS}")
    if grammar.kind is GrammarKind.JSON_SCHEMA:
        try:
            schema = json.loads(grammar.spec)
        except ValueError as exc:
            raise InvalidArgumentError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidArgumentError("the JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(grammar.spec, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    if grammar.kind is GrammarKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(grammar.spec)
    return llguidance.LLMatcher.grammar_from_lark(grammar.spec)


def engine_tokenizer(hf_tokenizer: Any, vocab_size: int | None,
                     eos_token_ids: list[int] | None) -> llguidance.LLTokenizer:
    """llguidance's view of the served tokenizer over the model's `vocab_size` logits (None: the tokenizer's).

    Ids past the tokenizer's own vocabulary (a padded embedding table) are never allowed; with no
    `eos_token_ids` the tokenizer's own EOS ends a grammar.
    """
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)
    except Exception as exc:  # a slow (non-Rust) tokenizer, or one llguidance cannot read
        raise InvalidArgumentError(f"structured output is not available for this model's tokenizer: {exc}") from exc


def compile_grammar(grammar: Grammar, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A fresh matcher at the start of `grammar`; InvalidArgumentError naming what is wrong.

    Slow for a large schema (up to ~1 s): call it off the event loop, and cache the result
    (`LLMatcher.deep_copy` gives each request its own matcher cheaply).
    """
    text = engine_grammar(grammar)
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise InvalidArgumentError(f"invalid {grammar.kind.value}: {matcher.get_error()}")
    return matcher
