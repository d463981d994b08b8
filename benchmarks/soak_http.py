"""Send one soak `Shape` to the OpenAI HTTP API (completions or chat, streamed or not) and judge it.

An abort closes the connection mid-stream (after some chunks) or mid-request (after some
time, perhaps before the response started): the frontend sees a client that went away and must
abort the request in the scheduler. Never raises for what the server does.
"""

from __future__ import annotations

import json

import aiohttp

from benchmarks.soak_outcome import ABORTED, AbortTimer, Outcome, judge_failure, judge_finish, judge_refusal
from benchmarks.soak_shapes import Shape


def http_body(shape: Shape, model: str) -> bytes:
    """The request body (OpenAI field names); a `bad_json` shape gets it cut in half."""
    body: dict[str, object] = {"model": model, **shape.sampling, "stream": shape.stream}
    if shape.protocol == "http-chat" and "logprobs" in body:
        body["top_logprobs"] = body.pop("logprobs")
        body["logprobs"] = True
    if shape.stream:
        body["stream_options"] = {"include_usage": True}
    if shape.protocol == "http-chat":
        system = [{"role": "system", "content": shape.system}] if shape.system else []
        body["messages"] = [*system, {"role": "user", "content": shape.prompt}]
    else:
        body["prompt"] = shape.prompt
    raw = json.dumps(body).encode()
    return raw[: len(raw) // 2] if shape.invalid == "bad_json" else raw


class _Seen:
    """What an SSE stream said so far: chunks, output tokens, finish reason, `[DONE]`, an error event."""

    def __init__(self) -> None:
        self.chunks = 0
        self.tokens = 0  # chunks with output, until the usage chunk gives the exact count
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.done = False

    def take(self, raw: bytes) -> bool:
        """Take one SSE line; True at `[DONE]` or an error event (the stream is over)."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return False
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            self.done = True
            return True
        chunk = json.loads(data)
        if chunk.get("error"):
            self.error = json.dumps(chunk["error"])
            return True
        for choice in chunk.get("choices") or []:
            self.chunks += 1
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                self.tokens += 1
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.tokens = int(usage["completion_tokens"])
        return False

    def outcome(self, shape: Shape) -> Outcome:
        if self.error is not None:
            return judge_failure(shape, self.tokens, f"in-stream error {self.error}")
        if not self.done:
            return judge_failure(shape, self.tokens, "stream ended without [DONE]")
        return judge_finish(shape, self.finish_reason, self.tokens)


def _whole_body(shape: Shape, body: dict[str, object]) -> Outcome:
    """A non-streamed response: finish reason of the one choice, tokens from usage."""
    choices = body.get("choices")
    usage = body.get("usage")
    if not (isinstance(choices, list) and choices and isinstance(usage, dict)):
        return judge_failure(shape, 0, f"response without choices or usage: {json.dumps(body)[:120]}")
    return judge_finish(shape, choices[0].get("finish_reason"), int(usage.get("completion_tokens", -1)))


async def send_http(session: aiohttp.ClientSession, base_url: str, model: str, shape: Shape) -> Outcome:
    """POST one request to `base_url` and read it to the end, or abort it as `shape.abort` says."""
    path = "/v1/chat/completions" if shape.protocol == "http-chat" else "/v1/completions"
    abort = shape.abort
    timer = AbortTimer(abort.after_s if abort else None)
    resp: aiohttp.ClientResponse | None = None
    seen = _Seen()
    try:
        async with timer.scope:
            resp = await session.post(base_url + path, data=http_body(shape, model),
                                      headers={"content-type": "application/json"})
            if resp.status != 200:
                return judge_refusal(shape, str(resp.status), await resp.text())
            if not shape.stream:
                return _whole_body(shape, await resp.json())
            async for line in resp.content:
                if seen.take(line):
                    break
                if abort is not None and abort.after_chunks is not None and seen.chunks >= abort.after_chunks:
                    resp.close()  # hang up mid-stream
                    return Outcome(ABORTED, shape.protocol, seen.tokens)
            return seen.outcome(shape)
    except TimeoutError:
        if not timer.fired():
            return judge_failure(shape, seen.tokens, "client timeout: the request hung")
        if resp is not None:
            resp.close()
        return Outcome(ABORTED, shape.protocol, seen.tokens)
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a body or event that is not JSON
        return judge_failure(shape, seen.tokens, f"{type(exc).__name__}: {exc}")
    finally:
        if resp is not None:
            resp.release()
