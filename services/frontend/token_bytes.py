"""Each token's UTF-8 bytes, so byte-level BPE output decodes with no tokenizer call per step.

For a byte-level BPE tokenizer (GPT-2 style: Llama 3, Qwen, the test models), decoding is the
concatenation of each token's bytes: the vocabulary's strings map characters back to bytes
one for one, added tokens are their own text, and special ones are dropped when skipped. So
the detokenizer can look bytes up in a table and feed them to an incremental UTF-8 decoder:
one table read per token instead of two `decode` calls per step.

The table is used only where that is exactly what `decode` does: a ByteLevel decoder, no
clean-up of tokenization spaces, and `build` checks it against `decode` on random sequences
(special tokens included, skipped and kept) before returning it. Any other tokenizer
(SentencePiece's Metaspace, WordPiece) gets None and the windowed decode of detokenizer.py.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

logger = logging.getLogger(__name__)

_NUM_CHECKS = 64
_CHECK_LEN = 24


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible map: printable bytes as themselves, the rest shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shift)] = byte
            shift += 1
    return chars


class TokenBytes:
    """`bytes_of(ids, skip_special)`: what `decode` would produce, as UTF-8 bytes."""

    def __init__(self, table: list[bytes], special_ids: set[int]) -> None:
        self._table = table
        self._special = special_ids

    def bytes_of(self, token_ids: list[int], skip_special_tokens: bool) -> bytes:
        """Ids past the tokenizer's vocabulary (a model's padded embedding rows) decode to nothing, as in `decode`."""
        table, special, size = self._table, self._special, len(self._table)
        if skip_special_tokens:
            return b"".join(table[i] for i in token_ids if i < size and i not in special)
        return b"".join(table[i] for i in token_ids if i < size)

    @classmethod
    def build(cls, hf: Any) -> TokenBytes | None:
        """The table for `hf` (a transformers fast tokenizer), or None where it would not equal `decode`."""
        try:
            decoder = json.loads(hf.backend_tokenizer.to_str()).get("decoder") or {}
        except (AttributeError, ValueError):
            return None
        if decoder.get("type") != "ByteLevel" or getattr(hf, "clean_up_tokenization_spaces", False):
            return None
        alphabet = _byte_level_alphabet()
        added = {i: token.content for i, token in hf.added_tokens_decoder.items()}
        table = []
        for token_id, piece in enumerate(hf.convert_ids_to_tokens(list(range(len(hf))))):
            if token_id in added:
                table.append(added[token_id].encode())
            elif piece is None or any(c not in alphabet for c in piece):
                return None
            else:
                table.append(bytes(alphabet[c] for c in piece))
        special = {i for i, token in hf.added_tokens_decoder.items() if token.special} | set(hf.all_special_ids)
        token_bytes = cls(table, special)
        return token_bytes if token_bytes._agrees_with(hf) else None

    def _agrees_with(self, hf: Any) -> bool:
        rng = random.Random(0)
        specials = sorted(self._special)
        for check in range(_NUM_CHECKS):
            ids = [rng.randrange(len(self._table) + 8) for _ in range(_CHECK_LEN)]
            if specials and check % 2:
                ids[rng.randrange(_CHECK_LEN)] = rng.choice(specials)
            for skip in (True, False):
                if self.bytes_of(ids, skip).decode(errors="replace") != hf.decode(ids, skip_special_tokens=skip):
                    logger.info("byte table disagrees with decode on %s; using windowed decoding", ids)
                    return False
        return True
