"""Short inputs are encoded on the event loop while the tokenizer's pool is idle; long ones, and
any while the pool is busy, go to the pool, so the HF tokenizer never runs on two threads at once."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from services.frontend.messages import ChatMessage
from services.frontend.tokenizer import INLINE_MAX_CHARS, Tokenizer


def _recording(tokenizer: Tokenizer) -> list[str]:
    """Names of the threads that ran each encode, in order."""
    threads: list[str] = []
    encode, encode_batch, render = tokenizer._encode, tokenizer._encode_batch, tokenizer._render_chat

    def on_thread(fn):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            return fn(*args)
        return run

    tokenizer._encode = on_thread(encode)  # type: ignore[method-assign]
    tokenizer._encode_batch = on_thread(encode_batch)  # type: ignore[method-assign]
    tokenizer._render_chat = on_thread(render)  # type: ignore[method-assign]
    return threads


async def test_short_inputs_skip_the_pool_only_while_it_is_idle(tokenizer_dir: Path) -> None:
    tokenizer = Tokenizer(str(tokenizer_dir))
    threads = _recording(tokenizer)
    short, long = "hello world", "hello world " * (INLINE_MAX_CHARS // 6)
    loop_thread = threading.current_thread().name
    try:
        assert await tokenizer.encode(short) == await tokenizer.encode(short)
        await tokenizer.encode_batch([short, short])
        await tokenizer.encode_pairs([(short, short)])
        assert threads == [loop_thread] * 4
        threads.clear()

        inline = await tokenizer.encode(short)
        pooled = await tokenizer.encode(long)
        assert threads == [loop_thread, "tokenizer_0"] and len(pooled) > len(inline)
        threads.clear()

        # A short chat renders (and encodes) on the loop; one with tools renders on the pool.
        chat = [ChatMessage("user", short)]
        assert await tokenizer.encode_chat(chat) == await tokenizer.encode_chat(chat, tools=None)
        assert threads == [loop_thread] * 4
        threads.clear()
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        await tokenizer.encode_chat(chat, tools=[tool])
        assert threads == ["tokenizer_0", loop_thread]
        threads.clear()

        # A long encode in flight: the short one queues behind it on the pool instead of running beside it.
        both = await asyncio.gather(tokenizer.encode(long), tokenizer.encode(short))
        assert threads == ["tokenizer_0", "tokenizer_0"] and both[1] == inline
        assert tokenizer._num_in_pool == 0
    finally:
        tokenizer.close()
