"""Structured output on the worker: one grammar matcher per request, and each step's token mask.

The worker advances every matcher itself with each sampled token (`consume`), so a
multi-step round needs no round trip to the frontend: before each step samples, `mask`
computes the allowed tokens of the rows that carry a grammar (only those; rows without one
cost nothing) as a packed bitmask, copied to the device in one transfer, where the sampler
expands and applies it. A request (re-)added after a preemption or a journal resume replays
its already generated tokens through a fresh matcher, so it continues where it was.

When a grammar is complete the matcher allows only EOS, so the request ends with a stop
token ("stop"). A matcher that cannot continue (a grammar the worker cannot compile, which
the frontend's validation should have caught) also allows only EOS: the request ends, the
others in the batch never notice.

Compiled grammars are cached by spec (`LLMatcher.deep_copy` per request is cheap). The HF
tokenizer llguidance needs is loaded on the first structured request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from shared.errors import InvalidArgumentError
from shared.grammar import Grammar, compile_grammar, engine_tokenizer

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 128


@dataclass(slots=True)
class TokenMask:
    """Allowed tokens of some sampling rows, bit-packed (bit t % 32 of word t // 32)."""

    batch_rows: torch.Tensor  # [G] int64, sampling rows that carry a grammar
    bitmask: torch.Tensor  # [G, ceil(V / 32)] int32


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the logits of every disallowed token of the masked rows to -inf, in place, on the device."""
    num_rows, vocab_size = mask.batch_rows.shape[0], logits.shape[1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((mask.bitmask[:, :, None] >> shifts) & 1).view(num_rows, -1)[:, :vocab_size].bool()
    rows = mask.batch_rows
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class GrammarState:
    """Grammar matchers of the live structured requests, by `RequestStates` row."""

    def __init__(self, model_dir: str | None, vocab_size: int, eos_token_ids: tuple[int, ...],
                 device: torch.device) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.words = (vocab_size + 31) // 32
        self.matchers: dict[int, llguidance.LLMatcher | None] = {}  # None: can only end (EOS only)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Grammar, llguidance.LLMatcher] = OrderedDict()
        self._eos_only = np.zeros(self.words, np.int32)
        for t in eos_token_ids:
            if 0 <= t < vocab_size:
                self._eos_only.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))

    @property
    def active(self) -> bool:
        return bool(self.matchers)

    def add(self, row: int, grammar: Grammar, output_token_ids: list[int]) -> None:
        """Start `row`'s matcher and advance it over the tokens it generated before (resume)."""
        try:
            matcher: llguidance.LLMatcher | None = self._compile(grammar).deep_copy()
        except InvalidArgumentError as exc:
            logger.error("structured request cannot be constrained, it ends now: %s", exc)
            matcher = None
        if matcher is not None and output_token_ids and not matcher.consume_tokens(output_token_ids):
            logger.error("replaying %d generated tokens through the grammar failed: %s", len(output_token_ids),
                         matcher.get_error())
            matcher = None
        self.matchers[row] = matcher

    def clear(self) -> None:
        """Forget every request (a new Execute stream); compiled grammars stay cached."""
        self.matchers.clear()

    def release(self, rows: list[int]) -> None:
        for row in rows:
            self.matchers.pop(row, None)

    def consume(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Advance the matchers of `rows` (one sampled token each); rows without a grammar are skipped."""
        for row, token in zip(rows.tolist(), token_ids.tolist(), strict=True):
            matcher = self.matchers.get(row)
            if matcher is None or matcher.is_stopped():
                continue  # no grammar, or finished: later tokens of this round are discarded anyway
            if not matcher.consume_token(token):
                logger.error("sampled token %d is outside the grammar: %s", token, matcher.get_error())
                self.matchers[row] = None

    def mask(self, sample_rows: np.ndarray) -> TokenMask | None:
        """This step's mask for the sampling rows that carry a grammar; None when none does."""
        if not self.matchers:
            return None
        batch_rows = [i for i, row in enumerate(sample_rows.tolist()) if row in self.matchers]
        if not batch_rows:
            return None
        bitmask = np.empty((len(batch_rows), self.words), np.int32)
        for out, i in enumerate(batch_rows):
            matcher = self.matchers[int(sample_rows[i])]
            if matcher is None or matcher.is_error():
                bitmask[out] = self._eos_only
            else:
                matcher.unsafe_compute_mask_ptr(bitmask[out].ctypes.data, self.words * 4)
        return TokenMask(
            torch.tensor(batch_rows, dtype=torch.int64).to(self.device, non_blocking=True),
            torch.from_numpy(bitmask).to(self.device, non_blocking=True),
        )

    def _compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        cached = self._compiled.get(grammar)
        if cached is not None:
            self._compiled.move_to_end(grammar)
            return cached
        matcher = compile_grammar(grammar, self._engine_tokenizer())
        self._compiled[grammar] = matcher
        if len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return matcher

    def _engine_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if self.model_dir is None:
                raise InvalidArgumentError("this worker has no tokenizer, so it cannot serve structured output")
            from transformers import AutoTokenizer

            try:
                hf = AutoTokenizer.from_pretrained(self.model_dir)
            except Exception as exc:  # no tokenizer files beside the weights
                raise InvalidArgumentError(f"cannot load the tokenizer for structured output: {exc}") from exc
            self._tokenizer = engine_tokenizer(hf, self.vocab_size, list(self.eos_token_ids))
        return self._tokenizer
