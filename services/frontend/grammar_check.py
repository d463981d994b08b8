"""Early validation of structured-output grammars: compile once, off the event loop, cached.

A request's grammar is compiled here with the same engine and options the worker uses
(shared/grammar.py), so a schema the worker could not run is a 400 before the request is
queued, never a failure inside a batch. Compiling a large schema can take up to a second:
it runs in its own thread (the event loop and the tokenizer thread stay free), under a
size limit (checked first), llguidance's fuel limits, and a wall-clock limit. Outcomes,
failures included, are cached by spec, and concurrent requests with the same spec share one
compilation, so a client repeating a slow or broken schema costs nothing more.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import llguidance

from shared.errors import InvalidArgumentError
from shared.grammar import Grammar, compile_grammar, engine_tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")
COMPILE_TIMEOUT_S = 10.0
MAX_CACHED = 256


class GrammarChecker:
    """Validates grammars against the served tokenizer; `check` raises InvalidArgumentError."""

    def __init__(self, hf_tokenizer: Any, on_tokenizer_thread: Callable[[Callable[[], Any]], Awaitable[Any]],
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.hf_tokenizer = hf_tokenizer
        self._on_tokenizer_thread = on_tokenizer_thread  # HF tokenizers must not be used from two threads
        self.timeout_s = timeout_s
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._results: OrderedDict[Grammar, str] = OrderedDict()  # "" when valid, else the error
        self._inflight: dict[Grammar, asyncio.Future[str]] = {}

    async def check(self, grammar: Grammar) -> None:
        """Raise InvalidArgumentError when `grammar` is too large, invalid or too slow to compile."""
        error = self._results.get(grammar)
        if error is None:
            if self._tokenizer is None:  # once: llguidance's copy of the served tokenizer
                self._tokenizer = await self._on_tokenizer_thread(self._engine_tokenizer)
            future = self._inflight.get(grammar)
            if future is None:
                future = asyncio.get_running_loop().run_in_executor(self._pool, self._compile, grammar)
                self._inflight[grammar] = future
                future.add_done_callback(lambda _: self._inflight.pop(grammar, None))
            try:
                error = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
            except TimeoutError:
                error = (f"the {grammar.kind.value} took longer than {self.timeout_s:g} s to compile; "
                         "simplify it")
                logger.warning("grammar compilation timed out (%d characters)", len(grammar.spec))
            self._remember(grammar, error)
        if error:
            raise InvalidArgumentError(error)

    def _remember(self, grammar: Grammar, error: str) -> None:
        self._results[grammar] = error
        self._results.move_to_end(grammar)
        if len(self._results) > MAX_CACHED:
            self._results.popitem(last=False)

    def _engine_tokenizer(self) -> llguidance.LLTokenizer:
        eos = self.hf_tokenizer.eos_token_id
        return engine_tokenizer(self.hf_tokenizer, None, None if eos is None else [eos])

    def _compile(self, grammar: Grammar) -> str:
        """In the grammar thread: "" when `grammar` compiles, else why not."""
        assert self._tokenizer is not None
        try:
            compile_grammar(grammar, self._tokenizer)
        except InvalidArgumentError as exc:
            return exc.message
        return ""
