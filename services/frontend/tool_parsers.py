"""OpenAI function calling, output side: one choice's text, as it streams, -> content and tool calls.

One reader per choice; `feed` takes each new piece of text and `finish` the end, and both
return a `ToolDelta`: content for the client and call deltas in OpenAI's streaming shape. A
whole (non-streamed) answer feeds its text once, so both paths run the same code.

The model's own format, chosen from its chat template (`format_for_template`):

    hermes       Qwen2.5 / Qwen3 / Hermes (and spindle's generic prompt):
                 <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, repeated
    llama3_json  Llama 3.1+: [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]
    mistral      Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

plus the two forced forms that `tools.ToolRequest.grammar` constrains the output to: a named
function's arguments object, or a JSON array of {"name", "parameters"}. Text that looks like a
call but does not parse is returned as content: nothing the model wrote is lost.
"""

from __future__ import annotations

import enum
import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from services.frontend.messages import ToolCall
from services.frontend.tools import ToolRequest


class ToolCallFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


def format_for_template(chat_template: str) -> ToolCallFormat:
    """The tool-call format a chat template teaches its model; hermes when it teaches none."""
    if "[TOOL_CALLS]" in chat_template:
        return ToolCallFormat.MISTRAL
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return ToolCallFormat.LLAMA3_JSON
    return ToolCallFormat.HERMES


@dataclass(slots=True, frozen=True)
class CallDelta:
    """A piece of one call: the first carries its id and name, later ones more argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, object]:
        function: dict[str, object] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        body: dict[str, object] = {"index": self.index, "function": function}
        if self.id is not None:
            body = {"index": self.index, "id": self.id, "type": "function", "function": function}
        return body


@dataclass(slots=True)
class ToolDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_from_json(value: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed call object; None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class ToolCallReader(ABC):
    """Reads one choice's text; `calls` holds every call completed so far."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    @abstractmethod
    def feed(self, text: str) -> ToolDelta: ...

    @abstractmethod
    def finish(self) -> ToolDelta: ...

    def _complete(self, name: str, arguments: str) -> CallDelta:
        call = ToolCall(new_call_id(), name, arguments)
        self.calls.append(call)
        return CallDelta(len(self.calls) - 1, arguments, call.id, name)


class NamedFunctionReader(ToolCallReader):
    """tool_choice names a function: the whole output is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._arguments: list[str] = []

    def feed(self, text: str) -> ToolDelta:
        self._arguments.append(text)
        first = not self.calls
        call_id = new_call_id() if first else self.calls[0].id
        self.calls[:] = [ToolCall(call_id, self._name, "".join(self._arguments))]
        if first:
            return ToolDelta(calls=[CallDelta(0, text, call_id, self._name)])
        return ToolDelta(calls=[CallDelta(0, text)] if text else [])

    def finish(self) -> ToolDelta:
        return self.feed("") if not self.calls else ToolDelta()


class JsonArrayReader(ToolCallReader):
    """tool_choice required: a JSON array of {"name", "parameters"}; each call goes out when its
    object closes (a depth scan that knows strings and escapes)."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> ToolDelta:
        delta = ToolDelta()
        for char in text:
            if self._depth >= 2:
                self._buffer.append(char)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._buffer = [char]
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1 and (call := _call_from_json(_loads("".join(self._buffer)))) is not None:
                    delta.calls.append(self._complete(*call))
        return delta

    def finish(self) -> ToolDelta:
        return ToolDelta()  # an array cut short (max_tokens) keeps the calls it completed


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


class TaggedCallReader(ToolCallReader):
    """hermes: calls between <tool_call> and </tool_call>, content around them."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # text not yet handed on: a possible start of a tag, or an open call
        self._after_call = False  # newlines right after a call are the format's, not content

    def feed(self, text: str) -> ToolDelta:
        self._pending += text
        delta = ToolDelta()
        while True:
            if self._after_call:
                self._pending = self._pending.lstrip("\n")
                self._after_call = not self._pending
            start = self._pending.find(self.START)
            if start < 0:
                keep = _partial_suffix(self._pending, self.START)
                delta.content += self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return delta
            end = self._pending.find(self.END, start)
            if end < 0:
                delta.content += self._pending[:start]
                self._pending = self._pending[start:]
                return delta
            delta.content += self._pending[:start]
            self._read_call(self._pending[start:end + len(self.END)], delta)
            self._pending, self._after_call = self._pending[end + len(self.END):], True

    def finish(self) -> ToolDelta:
        """An open call at the end (a model that stopped before </tool_call>) still counts if it parses."""
        delta, rest, self._pending = ToolDelta(), self._pending, ""
        if rest.startswith(self.START):
            self._read_call(rest, delta)
        else:
            delta.content = rest
        return delta

    def _read_call(self, block: str, delta: ToolDelta) -> None:
        body = block[len(self.START):].removesuffix(self.END).strip()
        call = _call_from_json(_loads(body))
        if call is None:
            delta.content += block  # not a call after all: the client sees what the model wrote
        else:
            delta.calls.append(self._complete(*call))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: it may become the tag)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class LeadingJsonReader(ToolCallReader):
    """llama3_json and mistral: an answer that opens with a marker or with JSON is calls (read
    at the end, when the JSON is whole); any other answer streams as content."""

    def __init__(self, marker: str, opening: str) -> None:
        super().__init__()
        self._marker, self._opening = marker, opening
        self._head = ""  # the answer's start, until it shows which kind it is
        self._calls_mode: bool | None = None

    def feed(self, text: str) -> ToolDelta:
        if self._calls_mode is False:
            return ToolDelta(content=text)
        self._head += text
        if self._calls_mode is None:
            stripped = self._head.lstrip()
            if not stripped or (self._marker.startswith(stripped) and stripped != self._marker):
                return ToolDelta()  # still undecided
            self._calls_mode = stripped.startswith(self._marker) or stripped.startswith(self._opening)
            if not self._calls_mode:
                head, self._head = self._head, ""
                return ToolDelta(content=head)
        return ToolDelta()

    def finish(self) -> ToolDelta:
        head, self._head = self._head, ""
        if not self._calls_mode:
            return ToolDelta(content=head)
        calls = _json_calls(head.lstrip().removeprefix(self._marker))
        if calls is None:
            return ToolDelta(content=head)
        return ToolDelta(calls=[self._complete(*call) for call in calls])


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    """Calls in JSON values separated by whitespace or ';' (a list value holds several)."""
    decoder, position, values = json.JSONDecoder(), 0, []
    while True:
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
        if position == len(text):
            break
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        values.extend(value if isinstance(value, list) else [value])
    calls = [_call_from_json(value) for value in values]
    return None if not calls or None in calls else calls  # type: ignore[return-value]


def reader_for(tools: ToolRequest, model_format: ToolCallFormat) -> ToolCallReader:
    """The reader of one choice of a request whose tools are active."""
    if tools.choice == "function":
        return NamedFunctionReader(tools.function)
    if tools.choice == "required":
        return JsonArrayReader()
    if model_format is ToolCallFormat.LLAMA3_JSON:
        return LeadingJsonReader("<|python_tag|>", "{")
    if model_format is ToolCallFormat.MISTRAL:
        return LeadingJsonReader("[TOOL_CALLS]", "[")
    return TaggedCallReader()
