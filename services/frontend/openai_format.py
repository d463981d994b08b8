"""OpenAI response bodies: completions and chat, whole and as stream chunks; usage, logprobs, errors.

Pure functions from the frontend's dataclasses to JSON-ready dicts; the HTTP app serialises
(`dumps_json`). A request with n choices has one choice per index; stream chunks carry one choice
each, and a streamed text chunk comes encoded from a per-choice template (`chunk_json`).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.frontend.messages import (
    FinishReason,
    GenerateChunk,
    GenerateComplete,
    PositionLogprobs,
    ToolCall,
    Usage,
)
from services.frontend.tool_parsers import ToolCallFormat, ToolCallReader, ToolDelta, reader_for
from services.frontend.tools import ToolRequest
from shared.errors import ErrorKind, SpindleError

TokenText = Callable[[int], str]
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# Stands for a text chunk's text in its choice's template: a string no model name or id holds.
_TEXT_MARK = "\x00spindle-chunk-text\x00"


def dumps_json(body: object) -> bytes:
    """`body` as compact UTF-8 JSON, as every response body is sent."""
    return _JSON.encode(body).encode()


def _split_at_text(body: dict[str, object]) -> tuple[bytes, bytes] | None:
    """`body`'s JSON before and after its one `_TEXT_MARK` (None: not exactly one)."""
    parts = dumps_json(body).split(dumps_json(_TEXT_MARK))
    return (parts[0], parts[1]) if len(parts) == 2 else None
# JSON has no -inf; a token the model rules out gets this (as vLLM does).
_MIN_LOGPROB = -9999.0

ERROR_TYPES: dict[ErrorKind, str] = {
    ErrorKind.INVALID_ARGUMENT: "invalid_request_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.RESOURCE_EXHAUSTED: "rate_limit_error",
    ErrorKind.UNAVAILABLE: "service_unavailable_error",
    ErrorKind.DEADLINE_EXCEEDED: "timeout_error",
    ErrorKind.INTERNAL: "internal_error",
}


def error_body(error: SpindleError, status: int) -> dict[str, object]:
    return {"error": {"message": error.message, "type": ERROR_TYPES[error.kind], "param": None, "code": status}}


def usage_body(usage: Usage) -> dict[str, object]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def _logprob(value: float) -> float:
    return value if value > _MIN_LOGPROB else _MIN_LOGPROB


def completion_logprobs(positions: Sequence[PositionLogprobs], token_text: TokenText,
                        text_offset: int) -> dict[str, object]:
    """The legacy completions format: parallel lists plus one {token: logprob} dict per position."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for position in positions:
        token = token_text(position.chosen.token_id)
        tokens.append(token)
        token_logprobs.append(_logprob(position.chosen.logprob))
        top = {token_text(t.token_id): _logprob(t.logprob) for t in position.top}
        top.setdefault(token, _logprob(position.chosen.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(positions: Sequence[PositionLogprobs], token_text: TokenText) -> dict[str, object]:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def entry(token_id: int, logprob: float) -> dict[str, object]:
        token = token_text(token_id)
        return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode())}

    content = []
    for position in positions:
        item = entry(position.chosen.token_id, position.chosen.logprob)
        item["top_logprobs"] = [entry(t.token_id, t.logprob) for t in position.top]
        content.append(item)
    return {"content": content}


def _finish(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def completion_choice(index: int, text: str, finish: FinishReason | None, logprobs: dict[str, object] | None,
                      matched_stop: str | None = None) -> dict[str, object]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish(finish),
            "stop_reason": matched_stop}


def chat_choice(index: int, text: str, finish: FinishReason | None, logprobs: dict[str, object] | None,
                matched_stop: str | None = None, tool_calls: list[ToolCall] | None = None) -> dict[str, object]:
    message: dict[str, object] = {"role": "assistant", "content": text}
    if tool_calls:
        message["content"] = text or None
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in tool_calls]
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": _finish(finish),
            "stop_reason": matched_stop}


def _tool_delta(read: ToolDelta) -> dict[str, object]:
    delta: dict[str, object] = {}
    if read.content or not read.calls:
        delta["content"] = read.content
    if read.calls:
        delta["tool_calls"] = [call.to_openai() for call in read.calls]
    return delta


def chat_delta_choice(index: int, delta: dict[str, object], finish: FinishReason | None,
                      logprobs: dict[str, object] | None) -> dict[str, object]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": _finish(finish)}


def envelope(object_name: str, response_id: str, created: int, model: str, choices: list[dict[str, object]],
             usage: Usage | None = None, system_fingerprint: str | None = None) -> dict[str, object]:
    """The fields every completion / chat (chunk) object has."""
    body: dict[str, object] = {"id": response_id, "object": object_name, "created": created, "model": model,
                               "system_fingerprint": system_fingerprint, "choices": choices}
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


@dataclass(slots=True)
class Choice:
    """One choice of a whole (non-streamed) response, gathered from its events."""

    index: int
    texts: list[str] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    complete: GenerateComplete | None = None


class ResponseFormatter(ABC):
    """Builds one endpoint's response bodies; one instance per request (it tracks offsets).

    Args:
        include_usage: stream_options.include_usage: chunks carry "usage": null, a last one the usage.
        continuous_usage: stream_options.continuous_usage_stats: every chunk carries the usage so far.
        num_prompt_tokens: the prompt's length, for the usage so far.
    """

    object_name: str
    chunk_object_name: str

    def __init__(self, response_id: str, model: str, token_text: TokenText, include_usage: bool = False,
                 system_fingerprint: str | None = None, continuous_usage: bool = False,
                 num_prompt_tokens: int = 0) -> None:
        self.response_id = response_id
        self.model = model
        self.token_text = token_text
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.system_fingerprint = system_fingerprint
        self.created = int(time.time())
        self._num_prompt_tokens = num_prompt_tokens
        self._num_output_tokens = 0  # over every choice, for continuous usage
        self._templates: dict[int, tuple[bytes, bytes] | None] = {}  # per choice: see chunk_json

    def _chunk(self, choices: list[dict[str, object]], usage: Usage | None = None) -> dict[str, object]:
        if usage is None and self.continuous_usage:
            usage = Usage(self._num_prompt_tokens, self._num_output_tokens)
        body = envelope(self.chunk_object_name, self.response_id, self.created, self.model, choices, usage,
                        self.system_fingerprint)
        if self.include_usage and usage is None:
            body["usage"] = None
        return body

    def _whole(self, choices: list[dict[str, object]], usage: Usage) -> dict[str, object]:
        return envelope(self.object_name, self.response_id, self.created, self.model, choices, usage,
                        self.system_fingerprint)

    def usage_chunk(self, usage: Usage) -> dict[str, object]:
        """The extra last stream chunk of stream_options.include_usage: no choices, the usage."""
        return self._chunk([], usage)

    def chunk(self, chunk: GenerateChunk) -> dict[str, object]:
        """One stream chunk with a step's new text for one choice."""
        choice = self._chunk_choice(chunk)
        self._note(chunk)
        return self._chunk([choice])

    def chunk_json(self, chunk: GenerateChunk) -> bytes:
        """`dumps_json(self.chunk(chunk))`. A chunk of text alone (no logprobs, no running usage, a
        choice `_text_choice` has a plain form for) is spliced into its choice's template, made
        once: only the text is encoded per token, where json.dumps of the whole dict took ~4 us
        of the ~45 us of Python the frontend spent on a streamed token (64 streams)."""
        template = None if chunk.logprobs is not None or self.continuous_usage else self._template(chunk.index)
        if template is None:
            return dumps_json(self.chunk(chunk))
        self._note(chunk)
        before, after = template
        return before + dumps_json(chunk.text) + after

    def _template(self, index: int) -> tuple[bytes, bytes] | None:
        if index not in self._templates:
            choice = self._text_choice(index, _TEXT_MARK)
            self._templates[index] = None if choice is None else _split_at_text(self._chunk([choice]))
        return self._templates[index]

    def _note(self, chunk: GenerateChunk) -> None:
        """What every stream chunk counts (after its choice is made)."""
        if not chunk.is_prompt:
            self._num_output_tokens += len(chunk.token_ids)

    @abstractmethod
    def _text_choice(self, index: int, text: str) -> dict[str, object] | None:
        """The choice of a chunk of `text` without logprobs; None where this choice has no such plain form."""

    @abstractmethod
    def start_chunks(self, n: int) -> list[dict[str, object]]:
        """Chunks to send before any output (chat: the assistant role of each choice)."""

    @abstractmethod
    def _chunk_choice(self, chunk: GenerateChunk) -> dict[str, object]:
        """The choice of a stream chunk."""

    @abstractmethod
    def end_chunk(self, complete: GenerateComplete) -> dict[str, object]:
        """The stream chunk carrying one choice's finish reason."""

    @abstractmethod
    def response(self, choices: Sequence[Choice], usage: Usage) -> dict[str, object]:
        """The whole (non-streamed) response."""


class CompletionFormatter(ResponseFormatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._text_offsets: dict[int, int] = {}  # per choice: where its next text starts (logprobs.text_offset)

    def _logprobs(self, index: int, positions: list[PositionLogprobs] | None) -> dict[str, object] | None:
        if positions is None:
            return None
        return completion_logprobs(positions, self.token_text, self._text_offsets.get(index, 0))

    def start_chunks(self, n: int) -> list[dict[str, object]]:
        return []

    def _chunk_choice(self, chunk: GenerateChunk) -> dict[str, object]:
        return completion_choice(chunk.index, chunk.text, None, self._logprobs(chunk.index, chunk.logprobs))

    def _text_choice(self, index: int, text: str) -> dict[str, object] | None:
        return completion_choice(index, text, None, None)

    def _note(self, chunk: GenerateChunk) -> None:
        super()._note(chunk)
        self._text_offsets[chunk.index] = self._text_offsets.get(chunk.index, 0) + len(chunk.text)

    def end_chunk(self, complete: GenerateComplete) -> dict[str, object]:
        return self._chunk([completion_choice(complete.index, "", complete.finish_reason, None,
                                              complete.matched_stop)])

    def response(self, choices: Sequence[Choice], usage: Usage) -> dict[str, object]:
        bodies = []
        for choice in choices:
            assert choice.complete is not None
            bodies.append(completion_choice(choice.index, "".join(choice.texts), choice.complete.finish_reason,
                                            self._logprobs(choice.index, choice.logprobs),
                                            choice.complete.matched_stop))
        return self._whole(bodies, usage)


class ChatFormatter(ResponseFormatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._tools: ToolRequest | None = None
        self._readers: dict[int, ToolCallReader] = {}  # per choice
        self._tool_format = ToolCallFormat.HERMES

    def read_tool_calls(self, tools: ToolRequest, model_format: ToolCallFormat) -> None:
        """Answer with tool calls read from each choice's text (tools active in the request)."""
        self._tools, self._tool_format = tools, model_format

    def _reader(self, index: int) -> ToolCallReader | None:
        if self._tools is None:
            return None
        if index not in self._readers:
            self._readers[index] = reader_for(self._tools, self._tool_format)
        return self._readers[index]

    def _finish_reason(self, reader: ToolCallReader | None, reason: FinishReason | None) -> FinishReason | None:
        """stop becomes tool_calls when the answer made calls (not for a named function: OpenAI says stop)."""
        named = self._tools is not None and self._tools.choice == "function"
        if reader is not None and reader.calls and reason is FinishReason.STOP and not named:
            return FinishReason.TOOL_CALLS
        return reason

    def _logprobs(self, positions: list[PositionLogprobs] | None) -> dict[str, object] | None:
        return None if positions is None else chat_logprobs(positions, self.token_text)

    def start_chunks(self, n: int) -> list[dict[str, object]]:
        return [self._chunk([chat_delta_choice(i, {"role": "assistant", "content": ""}, None, None)])
                for i in range(n)]

    def _chunk_choice(self, chunk: GenerateChunk) -> dict[str, object]:
        reader = self._reader(chunk.index)
        delta = {"content": chunk.text} if reader is None else _tool_delta(reader.feed(chunk.text))
        return chat_delta_choice(chunk.index, delta, None, self._logprobs(chunk.logprobs))

    def _text_choice(self, index: int, text: str) -> dict[str, object] | None:
        if self._reader(index) is not None:  # tool calls are read from the text: no fixed form
            return None
        return chat_delta_choice(index, {"content": text}, None, None)

    def end_chunk(self, complete: GenerateComplete) -> dict[str, object]:
        reader = self._reader(complete.index)
        delta: dict[str, object] = {}
        if reader is not None and ((last := reader.finish()).content or last.calls):
            delta = _tool_delta(last)
        finish = self._finish_reason(reader, complete.finish_reason)
        return self._chunk([chat_delta_choice(complete.index, delta, finish, None)])

    def response(self, choices: Sequence[Choice], usage: Usage) -> dict[str, object]:
        bodies = []
        for choice in choices:
            assert choice.complete is not None
            text, calls, reader = "".join(choice.texts), None, self._reader(choice.index)
            if reader is not None:
                first, last = reader.feed(text), reader.finish()
                text, calls = first.content + last.content, reader.calls
            bodies.append(chat_choice(choice.index, text, self._finish_reason(reader, choice.complete.finish_reason),
                                      self._logprobs(choice.logprobs), choice.complete.matched_stop, calls))
        return self._whole(bodies, usage)
