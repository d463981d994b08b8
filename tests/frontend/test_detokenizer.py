"""Incremental detokenization equals one-shot decoding and never splits a character: the windowed
detokenizer and the byte-table one (byte-level BPE) alike."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.frontend.detokenizer import REPLACEMENT_CHAR, ByteDetokenizer, IncrementalDetokenizer, make_detokenizer
from services.frontend.token_bytes import TokenBytes
from services.frontend.tokenizer import Tokenizer

MULTIBYTE_TEXT = "数据 模型 服务 🙂 🚀 🧵 café naïve ∑ ∫ √ ≈ ≠ straße déjà vu"


@pytest.fixture(scope="module", params=["window", "bytes"])
def tokenizer(tokenizer_dir: Path, request: pytest.FixtureRequest) -> Tokenizer:
    """The tokenizer, with its byte table (the byte detokenizer) or without (the windowed one)."""
    tokenizer = Tokenizer(str(tokenizer_dir))
    assert tokenizer.token_bytes is not None, "a byte-level BPE tokenizer gets a byte table"
    if request.param == "window":
        tokenizer.token_bytes = None
    return tokenizer


def _detokenizer(tokenizer: Tokenizer, prompt: list[int] | None = None,
                 skip: bool = True) -> IncrementalDetokenizer | ByteDetokenizer:
    return make_detokenizer(tokenizer.decode, tokenizer.token_bytes, prompt or [], skip)


def _run(tokenizer: Tokenizer, ids: list[int], rng: random.Random, skip: bool = True,
         prompt: list[int] | None = None) -> tuple[list[str], str]:
    """Feed `ids` in random step sizes (1..3, as multi-step rounds do); return deltas and the flush."""
    detok = _detokenizer(tokenizer, prompt, skip)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.step(ids[i:i + n]))
        i += n
    return deltas, detok.flush()


def test_text_with_split_multibyte_chars_never_emits_replacement_char(tokenizer: Tokenizer) -> None:
    ids = tokenizer.hf.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any(REPLACEMENT_CHAR in p for p in pieces), "the test text must split some character across tokens"
    rng = random.Random(0)
    for _ in range(20):
        deltas, tail = _run(tokenizer, ids, rng)
        assert "".join(deltas) + tail == MULTIBYTE_TEXT
        assert all(REPLACEMENT_CHAR not in d for d in [*deltas, tail])


def test_one_token_at_a_time_emits_each_char_once_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.hf.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # one emoji, several byte tokens
    detok = _detokenizer(tokenizer)
    deltas = [detok.step([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🙂"


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences_decode_to_one_shot_decode(tokenizer: Tokenizer, skip: bool) -> None:
    rng = random.Random(1 + skip)
    for _ in range(400):
        # All ids of the model's vocabulary: specials, byte fragments, ids past the tokenizer's.
        ids = [rng.randrange(0, 512) for _ in range(rng.randint(1, 30))]
        deltas, tail = _run(tokenizer, ids, rng, skip)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip), ids
        # Only the final flush may end inside a character. (The byte decoder emits U+FFFD for
        # bytes already known to be invalid, which random ids produce, at once; an incomplete
        # character it holds back, as the multibyte tests check.)
        if tokenizer.token_bytes is None:
            assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas), ids


def test_prompt_context_keeps_output_identical_to_decoding_the_output_alone(tokenizer: Tokenizer) -> None:
    rng = random.Random(3)
    for _ in range(200):
        prompt = [rng.randrange(4, 512) for _ in range(rng.randint(1, 8))]
        ids = [rng.randrange(4, 512) for _ in range(rng.randint(1, 20))]
        deltas, tail = _run(tokenizer, ids, rng, prompt=prompt)
        assert "".join(deltas) + tail == tokenizer.decode(ids), (prompt, ids)


def test_special_tokens_are_skipped_unless_asked_for(tokenizer: Tokenizer) -> None:
    ids = [0, *tokenizer.hf.encode("hello", add_special_tokens=False), 1]
    skipped = _detokenizer(tokenizer, skip=True)
    kept = _detokenizer(tokenizer, skip=False)
    assert "".join(skipped.step([i]) for i in ids) + skipped.flush() == "hello"
    assert "".join(kept.step([i]) for i in ids) + kept.flush() == "<s>hello</s>"


def test_each_step_decodes_a_bounded_window(tokenizer: Tokenizer) -> None:
    """Cost per step must not grow with the output length (O(new tokens), not O(output))."""
    windows: list[int] = []

    def counting_decode(ids: list[int], skip: bool) -> str:
        windows.append(len(ids))
        return tokenizer.decode(ids, skip)

    ids = tokenizer.hf.encode(MULTIBYTE_TEXT * 40, add_special_tokens=False)
    detok = IncrementalDetokenizer(counting_decode)
    text = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert text == MULTIBYTE_TEXT * 40
    assert len(ids) > 1000
    assert max(windows) <= 8


def test_token_texts_are_unique_even_for_partial_characters(tokenizer: Tokenizer) -> None:
    """Logprob keys must not collide: byte fragments all decode to U+FFFD on their own."""
    vocab = range(len(tokenizer.hf))
    partial = [i for i in vocab if REPLACEMENT_CHAR in tokenizer.decode([i], False)]
    assert len(partial) > 5
    texts = [tokenizer.token_text(i) for i in partial]
    assert len(set(texts)) == len(texts)
    first = tokenizer.token_text(tokenizer.hf.encode("hello", add_special_tokens=False)[0])
    assert first and "hello".startswith(first)  # whole characters keep their plain text


def test_a_tokenizer_that_is_not_byte_level_gets_no_byte_table(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from shared.tiny_models import build_wordpiece_tokenizer

    build_wordpiece_tokenizer(tmp_path)
    assert TokenBytes.build(AutoTokenizer.from_pretrained(tmp_path)) is None
