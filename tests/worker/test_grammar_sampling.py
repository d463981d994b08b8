"""Structured output in the sampler: the grammar mask on the device, matchers advanced per token.

Random logits stand in for a model: whatever they favour, every sampled sequence must match
the grammar, rows without a grammar must be untouched, and a request re-added with tokens it
generated before (preemption, journal resume) must continue where it was.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from services.worker.grammar_state import GrammarState
from services.worker.sampler import Sampler
from services.worker.sampling_state import SamplingState
from shared.execute import NewRequestData
from shared.grammar import Grammar, GrammarKind
from shared.sampling import SamplingOptions
from shared.tiny_models import TinyModelSpec, build_model

CPU = torch.device("cpu")
REGEX = r"(cat|dog)-[0-9]{2,4}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("grammar") / "llama", TinyModelSpec(family="llama", seed=1))


def _setup(model_dir: Path, grammars: list[Grammar | None], outputs: list[list[int]] | None = None):  # noqa: ANN202
    config = json.loads((model_dir / "config.json").read_text())
    vocab, eos = config["vocab_size"], (config["eos_token_id"],)
    sampling, grammar_state = SamplingState(vocab, eos, CPU), GrammarState(str(model_dir), vocab, eos, CPU)
    for row, grammar in enumerate(grammars):
        output = outputs[row] if outputs else []
        opts = SamplingOptions(temperature=1.0, grammar=grammar)
        sampling.add(row, NewRequestData(f"r{row}", [5, 6, *output], 2, 0, [0], opts))
        if grammar is not None:
            grammar_state.add(row, grammar, output)
    return vocab, eos[0], sampling, grammar_state, Sampler(sampling.penalty_tables, torch.Generator().manual_seed(7))


def _generate(model_dir: Path, grammars: list[Grammar | None], steps: int, seed: int,
              outputs: list[list[int]] | None = None) -> tuple[list[list[int]], int]:
    vocab, eos, sampling, grammar_state, sampler = _setup(model_dir, grammars, outputs)
    rows = np.arange(len(grammars))
    metadata = sampling.build(rows)
    generated: list[list[int]] = [[] for _ in grammars]
    logits_gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        logits = torch.randn(len(grammars), vocab, generator=logits_gen) * 3
        tokens = sampler(logits, metadata, step, grammar_state.mask(rows)).token_ids.numpy()
        grammar_state.consume(rows, tokens)
        for row, token in enumerate(tokens.tolist()):
            generated[row].append(token)
    return generated, eos


def _text_until_eos(tokenizer, ids: list[int], eos: int) -> str | None:  # noqa: ANN001
    """The text before the first EOS; None when the sequence never ended."""
    return tokenizer.decode(ids[: ids.index(eos)]) if eos in ids else None


def test_every_sampled_sequence_matches_its_grammar_and_other_rows_are_free(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    grammars = [Grammar(GrammarKind.REGEX, REGEX), None, Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema)), None]
    for seed in range(4):
        generated, eos = _generate(model_dir, grammars, steps=40, seed=seed)
        regex_text = _text_until_eos(tokenizer, generated[0], eos)
        assert regex_text is not None and re.fullmatch(REGEX, regex_text), regex_text
        assert generated[0][generated[0].index(eos):] == [eos] * (40 - generated[0].index(eos))  # only EOS after
        json_text = _text_until_eos(tokenizer, generated[2], eos)
        assert json_text is not None
        value = json.loads(json_text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
        # Unmasked rows sample from the whole vocabulary: 40 random draws are far from one grammar.
        assert len(set(generated[1])) > 20 and len(set(generated[3])) > 20


def test_a_resumed_request_continues_its_grammar(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    before = tokenizer.encode("dog-4", add_special_tokens=False)
    generated, eos = _generate(model_dir, [Grammar(GrammarKind.REGEX, REGEX)], steps=12, seed=3, outputs=[before])
    text = tokenizer.decode(before) + _text_until_eos(tokenizer, generated[0], eos)
    assert re.fullmatch(REGEX, text) and text.startswith("dog-4"), text


def test_a_grammar_the_worker_cannot_compile_ends_only_that_request(model_dir: Path) -> None:
    generated, eos = _generate(model_dir, [Grammar(GrammarKind.REGEX, "[unclosed"), None], steps=3, seed=0)
    assert generated[0] == [eos] * 3
    assert generated[1] != [eos] * 3
