"""Incremental detokenization of one request's output: emit only text that is final.

A token can end in the middle of a multi-byte UTF-8 character (byte-level BPE) and some
tokenizers (SentencePiece) render a token differently depending on what precedes it. So,
as in vLLM, each step decodes a short window of tokens twice and emits only the text the new
tokens add, and only once it no longer ends with U+FFFD (an incomplete character):

    ids:  ... | prefix_offset ......... read_offset ......... len(ids)
                 [ already emitted, kept as context ][ new, not yet emitted ]
    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Each step costs O(window), not O(output), so a long generation stays cheap per token.
Byte-level BPE tokenizers need none of this: `ByteDetokenizer` looks each token's bytes up in
a table (token_bytes.py) and decodes them with an incremental UTF-8 decoder, which holds an
incomplete character back by itself; `make_detokenizer` picks it whenever a table exists.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from services.frontend.token_bytes import TokenBytes

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context, so the first output token decodes as it does mid-text.
_PROMPT_CONTEXT_TOKENS = 5
# Drop emitted tokens from the window buffer once this many pile up before prefix_offset.
_TRIM_AT = 1024

Decode = Callable[[list[int], bool], str]


class IncrementalDetokenizer:
    """Turns a request's output token ids, a few per step, into text deltas.

    Invariant: the concatenation of every `step` delta and the final `flush` equals the
    decoding of all output tokens (with the prompt's last tokens as context), and no delta
    but the flush ends inside a multi-byte character.

    Args:
        decode: `(token_ids, skip_special_tokens) -> str`, the tokenizer's decode.
        prompt_token_ids: the prompt; its last few tokens seed the window as context.
        skip_special_tokens: leave special tokens (EOS, ...) out of the text.
    """

    def __init__(self, decode: Decode, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # Context must end on a character boundary, or the first output bytes would merge
        # with the prompt's incomplete character instead of decoding as they do alone.
        if context and decode(context, skip_special_tokens).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add this step's tokens; return the text they complete (may be empty)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or a character is still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of the request: the text still held back, incomplete characters included."""
        prefix_text, new_text = self._window_texts()
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        prefix_text = self._decode(window[: self._read_offset - self._prefix_offset], self._skip)
        return prefix_text, self._decode(window, self._skip)


class ByteDetokenizer:
    """The same contract as `IncrementalDetokenizer`, with one table read per token and no decode call."""

    def __init__(self, token_bytes: TokenBytes, skip_special_tokens: bool = True) -> None:
        self._token_bytes = token_bytes
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def step(self, new_token_ids: Sequence[int]) -> str:
        return self._utf8.decode(self._token_bytes.bytes_of(list(new_token_ids), self._skip))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def make_detokenizer(decode: Decode, token_bytes: TokenBytes | None, prompt_token_ids: Sequence[int] = (),
                     skip_special_tokens: bool = True) -> IncrementalDetokenizer | ByteDetokenizer:
    """The byte-table detokenizer where the tokenizer has a table, the windowed one otherwise."""
    if token_bytes is not None:
        return ByteDetokenizer(token_bytes, skip_special_tokens)
    return IncrementalDetokenizer(decode, prompt_token_ids, skip_special_tokens)
