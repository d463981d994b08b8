"""The served model's Hugging Face tokenizer: encoding and chat templates off the event loop.

Encoding a long prompt takes milliseconds, so it runs in a small thread pool (one thread by
default: HF fast tokenizers must not be used from two threads at once). A short input (up to
INLINE_MAX_CHARS; a chat without tools by its messages' text) is rendered and encoded on the
event loop when the pool has nothing in flight: that takes a fraction of a millisecond, less
than the hand-off, which wakes the pool's thread and then the loop again, each wake-up waiting
for a core that the model's threads may hold (embeddings at one stream: 1.4 ms a request).
Decoding is done on the loop by the detokenizer, a few tokens at a time.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from services.frontend.messages import ChatMessage, TokenizeResult
from services.frontend.token_bytes import TokenBytes
from shared.errors import InvalidArgumentError

logger = logging.getLogger(__name__)
T = TypeVar("T")

INLINE_MAX_CHARS = 2048  # ~0.1-0.2 ms to encode with a fast tokenizer; a short chat renders in ~25 us


@dataclass(slots=True)
class Encoded:
    """One tokenized input of a pooling request."""

    token_ids: list[int]
    token_type_ids: list[int] = field(default_factory=list)  # segment ids of a (query, document) pair


class Tokenizer:
    """Wraps `transformers.AutoTokenizer` loaded from the model directory."""

    def __init__(self, model_dir: str, num_threads: int = 1) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        self.token_bytes = TokenBytes.build(self.hf)  # None: the detokenizer decodes windows instead
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenizer")
        self._num_in_pool = 0  # calls submitted to the pool and not yet done
        logger.info("tokenizer loaded from %s (%d tokens, chat template: %s, byte table: %s)", model_dir,
                    len(self.hf), "yes" if self.has_chat_template else "no", "yes" if self.token_bytes else "no")

    async def _run(self, fn: Callable[[], T], num_chars: int | None = None) -> T:
        """fn() on the pool's thread, or on the loop for up to INLINE_MAX_CHARS of input while the
        pool is idle (every call is submitted from the loop, so none can start beside it)."""
        if num_chars is not None and num_chars <= INLINE_MAX_CHARS and not self._num_in_pool:
            return fn()
        self._num_in_pool += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self._num_in_pool -= 1

    async def run_exclusive(self, fn: Callable[[], T]) -> T:
        """Run `fn`, which reads `hf`, on the tokenizer's thread (never beside an encode)."""
        return await self._run(fn)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with BOS etc. when `add_special_tokens`)."""
        return await self._run(functools.partial(self._encode, text, add_special_tokens), len(text))

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can decode (the model's embedding table may be padded beyond them)."""
        return len(self.hf)

    @property
    def chat_template(self) -> str:
        """The chat template's text ("" without one): what it says decides the tool-call format."""
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else json.dumps(template or "")

    def _render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                     tools: list[dict[str, object]] | None = None) -> str:
        conversation = [m.to_template() for m in messages]
        try:
            return str(self.hf.apply_chat_template(conversation, tools=tools, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt))
        except Exception as exc:  # jinja2 errors raised by the template itself (e.g. role order)
            raise InvalidArgumentError(f"messages: the chat template rejected them: {exc}") from exc

    async def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          add_special_tokens: bool = False, tools: list[dict[str, object]] | None = None) -> list[int]:
        """Apply the model's chat template (with the generation prompt and `tools`) and tokenize the result.

        The rendered template already holds the special tokens (BOS), so none are added again
        unless `add_special_tokens` (vLLM's /tokenize option) asks for them.
        """
        if not self.has_chat_template:
            raise InvalidArgumentError(
                "this model has no chat template, so chat requests are not supported; "
                "use /v1/completions with a prompt instead"
            )
        size = None if tools else sum(len(m.content) for m in messages)  # tools' schemas: the pool (unsized)
        text = await self._run(functools.partial(self._render_chat, messages, add_generation_prompt, tools), size)
        return await self.encode(text, add_special_tokens=add_special_tokens)

    def _encode_batch(self, texts: list[str] | list[tuple[str, str]], max_length: int | None) -> list[Encoded]:
        out = self.hf(texts, add_special_tokens=True, truncation="longest_first" if max_length else False,
                      max_length=max_length)
        type_ids = out.get("token_type_ids") if texts and isinstance(texts[0], tuple) else None
        return [Encoded(list(ids), list(type_ids[i]) if type_ids else []) for i, ids in enumerate(out["input_ids"])]

    async def encode_batch(self, texts: list[str], max_length: int | None = None) -> list[Encoded]:
        """Token ids of several texts in one call (embeddings); cut to `max_length` when given."""
        return await self._run(functools.partial(self._encode_batch, texts, max_length), sum(map(len, texts)))

    async def encode_pairs(self, pairs: list[tuple[str, str]], max_length: int | None = None) -> list[Encoded]:
        """(query, document) pairs encoded together, with segment ids (cross-encoders)."""
        return await self._run(functools.partial(self._encode_batch, pairs, max_length),
                               sum(len(q) + len(d) for q, d in pairs))

    async def tokenize(self, text: str, add_special_tokens: bool) -> TokenizeResult:
        """Token ids of `text` and the text piece of each (the Tokenize RPC)."""
        ids = await self.encode(text, add_special_tokens)
        return TokenizeResult(token_ids=ids, tokens=[self.token_text(i) for i in ids])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one Tokenizer lives as long as the process
    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (special tokens included), for logprobs and Tokenize.

        A token holding part of a multi-byte character decodes to U+FFFD, so several would
        share one text (and collide as keys of OpenAI's top_logprobs); those get their raw
        vocabulary entry instead, which is unique per id.
        """
        text = str(self.hf.decode([token_id], skip_special_tokens=False))
        if text and "\ufffd" not in text:
            return text
        piece = self.hf.convert_ids_to_tokens(token_id)
        return str(piece) if piece else f"<token {token_id}>"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
