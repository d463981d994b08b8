"""OpenAI request bodies (/v1/completions, /v1/chat/completions) -> `GenerateInput`.

Checks JSON types field by field (a wrong type is a 400 naming the field), maps OpenAI and
vLLM-style extra fields onto `SamplingRequest`, and rejects features spindle does not serve
(suffix, echo with logprobs, ...) with a clear message instead of ignoring them.
Range checks are `validation.py`'s job. Unknown fields are ignored, as OpenAI clients send many.
Whatever the body holds, parsing fails only with a 400: bytes that are not UTF-8, lone
surrogates (`"\\ud800"`, which no tokenizer or encoder accepts), nesting deeper than the
parser's stack, numbers too large for a float; error messages never echo more than a short
excerpt of a client's value.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from dataclasses import dataclass

from aiohttp import web

from services.frontend.messages import IMAGE_MARKER, ChatMessage, GenerateInput, SamplingRequest, ToolCall
from services.frontend.response_format import parse_grammar
from services.frontend.tools import parse_tools
from services.frontend.validation import quote, show_number
from shared.errors import InvalidArgumentError, PayloadTooLargeError

# A \u escape of a UTF-16 surrogate: only these can put a lone surrogate into parsed JSON text.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(slots=True)
class OpenAIRequest:
    """A parsed request: what to generate and how to answer."""

    endpoint: Endpoint
    input: GenerateInput
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk


async def read_json(request: web.Request) -> object:
    """The body as JSON, read only up to the app's `client_max_size` (max_body_bytes): 413 past it."""
    limit = request.client_max_size
    size = request.content_length
    try:
        if size is not None and size > limit:  # refuse before reading any of it
            raise web.HTTPRequestEntityTooLarge(limit, size)
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLargeError(f"the request body is too large: more than the limit of {limit} bytes "
                                   "(max_body_bytes)") from exc
    return parse_json(raw)


def parse_json(raw: bytes) -> object:
    """The request body as JSON; malformed JSON (or not UTF-8, or not Unicode) is a 400."""
    try:
        text = raw.decode("utf-8-sig")  # RFC 8259: JSON between systems is UTF-8
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"the request body is not valid UTF-8: {exc}") from exc
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidArgumentError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidArgumentError("the request body is not valid JSON: it is nested too deeply") from exc
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise InvalidArgumentError("the request body is not valid Unicode: a string holds a lone surrogate "
                                   "(a \\ud800-\\udfff escape that is not half of a pair)")
    return value


def _has_lone_surrogate(value: object) -> bool:
    """Whether any string (or key) in the parsed JSON cannot be encoded as UTF-8."""
    stack = [value]
    while stack:  # iterative: the document may be as deep as the parser allowed
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
    return False


class JsonObject:
    """Typed access to one JSON object's fields; a wrong type raises a 400 naming the field."""

    def __init__(self, value: object, where: str = "the request body") -> None:
        if not isinstance(value, dict):
            raise InvalidArgumentError(f"{where} must be a JSON object, got {type_name(value)}")
        self._data: dict[str, object] = value
        self._prefix = "" if where == "the request body" else f"{where}."

    def raw(self, name: str) -> object:
        return self._data.get(name)

    def _fail(self, name: str, expected: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{self._prefix}{name} must be {expected}, got {describe(self._data[name])}")

    def get_int(self, name: str) -> int | None:
        value = self._data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(name, "an integer")
        return value

    def get_float(self, name: str) -> float | None:
        value = self._data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._fail(name, "a number")
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float: out of every range
            raise InvalidArgumentError(f"{self._prefix}{name}={show_number(value)} is out of range") from None

    def get_bool(self, name: str, default: bool = False) -> bool:
        value = self._data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(name, "a boolean")
        return value

    def get_str(self, name: str) -> str | None:
        value = self._data.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self._fail(name, "a string")
        return value

    def int_list(self, name: str) -> list[int] | None:
        value = self._data.get(name)
        if value is None:
            return None
        if not is_int_list(value):
            raise self._fail(name, "a list of integers")
        return value  # type: ignore[return-value]

    def str_or_str_list(self, name: str) -> list[str] | None:
        value = self._data.get(name)
        if value is None:
            return None
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._fail(name, "a string or a list of strings")
        return value

    def reject_if(self, name: str, unsupported: bool, message: str) -> None:
        if name in self._data and self._data[name] is not None and unsupported:
            raise InvalidArgumentError(message)


def type_name(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def describe(value: object) -> str:
    """A JSON value for an error message: its type, and a short excerpt of a scalar."""
    if isinstance(value, str):
        return f"string {quote(value)}"
    if isinstance(value, list | dict):
        return f"{type_name(value)} of {len(value)} {'items' if isinstance(value, list) else 'fields'}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{type_name(value)} {show_number(value)}"
    return f"{type_name(value)} {value!r}" if value is not None else "null"


def is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _logit_bias(body: JsonObject) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map as (id, bias) pairs; ranges are validation's job."""
    raw = body.raw("logit_bias")
    if raw is None:
        return ()
    entries = JsonObject(raw, "logit_bias")
    pairs = []
    for key in raw:  # type: ignore[union-attr]
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidArgumentError(f"logit_bias keys must be token ids (integers as strings), got "
                                       f"{quote(key)}") from None
        bias = entries.get_float(key)
        if bias is None:
            raise InvalidArgumentError(f"logit_bias.{key} must be a number, got null")
        pairs.append((token_id, bias))
    return tuple(pairs)


def _sampling(body: JsonObject, max_tokens: int | None, logprobs: int | None) -> SamplingRequest:
    """The sampling fields both endpoints share (OpenAI's plus vLLM-style extras)."""
    return SamplingRequest(
        temperature=body.get_float("temperature"),
        top_p=body.get_float("top_p"),
        top_k=body.get_int("top_k"),
        min_p=body.get_float("min_p"),
        seed=body.get_int("seed"),
        repetition_penalty=body.get_float("repetition_penalty"),
        presence_penalty=body.get_float("presence_penalty"),
        frequency_penalty=body.get_float("frequency_penalty"),
        max_tokens=max_tokens,
        min_tokens=body.get_int("min_tokens"),
        stop=tuple(body.str_or_str_list("stop") or ()),
        stop_token_ids=tuple(body.int_list("stop_token_ids") or ()),
        ignore_eos=body.get_bool("ignore_eos"),
        logprobs=logprobs,
        logit_bias=_logit_bias(body),
        grammar=parse_grammar(body.raw("response_format"), body.raw("structured_outputs")),
    )


def _common(body: JsonObject, endpoint: Endpoint, generate: GenerateInput) -> OpenAIRequest:
    """The fields both endpoints share: n, stream and stream_options."""
    n = body.get_int("n")
    generate.n = 1 if n is None else n
    stream = body.get_bool("stream")
    raw_options = body.raw("stream_options")
    options = JsonObject(raw_options, "stream_options") if raw_options is not None else None
    if options is not None and not stream:
        raise InvalidArgumentError("stream_options is only allowed when stream is true")
    include_usage = options.get_bool("include_usage") if options is not None else False
    continuous = options.get_bool("continuous_usage_stats") if options is not None else False
    return OpenAIRequest(endpoint, generate, stream, include_usage, continuous)


def parse_completion(data: object) -> OpenAIRequest:
    """A /v1/completions body. The prompt is a string or a list of token ids (one prompt only)."""
    body = JsonObject(data)
    echo = body.get_bool("echo")
    logprobs = body.get_int("logprobs")
    body.reject_if("echo", echo and logprobs is not None,
                   "echo with logprobs is not supported: it returns the prompt's log-probabilities, which "
                   "spindle does not compute; send echo without logprobs, or logprobs without echo")
    body.reject_if("suffix", bool(body.get_str("suffix")),
                   "suffix is not supported: the served model has no fill-in-the-middle (insertion) mode")
    prompt = body.raw("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        raise InvalidArgumentError(f"prompt holds {len(prompt)} prompts; only one prompt per request is supported")
    if prompt is None:
        raise InvalidArgumentError("prompt is required")
    if not isinstance(prompt, str) and not is_int_list(prompt):
        raise InvalidArgumentError(f"prompt must be a string or a list of token ids, got {type_name(prompt)}")
    generate = GenerateInput(
        model=body.get_str("model") or "",
        prompt_text=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=None if isinstance(prompt, str) else prompt,  # type: ignore[arg-type]
        sampling=_sampling(body, body.get_int("max_tokens"), logprobs),
        skip_special_tokens=body.get_bool("skip_special_tokens", default=True),
        add_special_tokens=body.get_bool("add_special_tokens", default=True),
        priority=body.get_int("priority") or 0,
        best_of=body.get_int("best_of"),
        echo=echo,
    )
    parsed = _common(body, Endpoint.COMPLETIONS, generate)
    if parsed.stream and generate.best_of is not None and generate.best_of != generate.n:
        raise InvalidArgumentError(f"best_of={show_number(generate.best_of)} with n={show_number(generate.n)} cannot "
                                   "be streamed: the best candidates are known only when all have finished")
    return parsed


def parse_chat(data: object) -> OpenAIRequest:
    """A /v1/chat/completions body with text messages."""
    body = JsonObject(data)
    tools = parse_tools(body.raw("tools"), body.raw("tool_choice"), body.raw("parallel_tool_calls"))
    raw_messages = body.raw("messages")
    if not isinstance(raw_messages, list):
        raise InvalidArgumentError(f"messages must be a list of messages, got {type_name(raw_messages)}")
    max_tokens = _max_completion_tokens(body)
    logprobs = (body.get_int("top_logprobs") or 0) if body.get_bool("logprobs") else None
    body.reject_if("top_logprobs", logprobs is None and body.get_int("top_logprobs") is not None,
                   "top_logprobs requires logprobs to be true")
    sampling = _sampling(body, max_tokens, logprobs)
    if tools is not None and (forced := tools.grammar()) is not None:
        if sampling.grammar is not None:
            raise InvalidArgumentError(f"tool_choice {tools.choice!r} constrains the output to tool calls; it "
                                       "cannot be combined with response_format or structured_outputs")
        sampling = dataclasses.replace(sampling, grammar=forced)
    generate = GenerateInput(
        model=body.get_str("model") or "",
        messages=(messages := [parse_message(m, i) for i, m in enumerate(raw_messages)]),
        images=[url for message in messages for url in message.images],
        sampling=sampling,
        skip_special_tokens=body.get_bool("skip_special_tokens", default=True),
        priority=body.get_int("priority") or 0,
        tools=tools,
    )
    return _common(body, Endpoint.CHAT, generate)


def _max_completion_tokens(body: JsonObject) -> int | None:
    """Chat's output limit: max_completion_tokens, or the older max_tokens it replaces (an alias).

    Both given and equal is fine; both given and different is a 400, since silently obeying
    one would hide a client bug.
    """
    new, old = body.get_int("max_completion_tokens"), body.get_int("max_tokens")
    if new is not None and old is not None and new != old:
        raise InvalidArgumentError(f"max_completion_tokens={show_number(new)} and max_tokens={show_number(old)} "
                                   "disagree: send only max_completion_tokens (max_tokens is its deprecated alias)")
    return new if new is not None else old


def parse_message(value: object, index: int) -> ChatMessage:
    """messages[index] of a chat body: text and image_url parts (OpenAI's shape), an assistant's
    tool_calls, a tool result's tool_call_id."""
    where = f"messages[{index}]"
    message = JsonObject(value, where)
    role = message.get_str("role")
    if not role:
        raise InvalidArgumentError(f"{where}.role is required")
    tool_fields = {"tool_calls": _tool_calls(message.raw("tool_calls"), where),
                   "tool_call_id": message.get_str("tool_call_id") or "", "name": message.get_str("name") or ""}
    return dataclasses.replace(_message_content(message, role, where), **tool_fields)


def _tool_calls(value: object, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidArgumentError(f"{where}.tool_calls must be a list, got {type_name(value)}")
    calls = []
    for i, item in enumerate(value):
        call = JsonObject(item, f"{where}.tool_calls[{i}]")
        function = JsonObject(call.raw("function"), f"{where}.tool_calls[{i}].function")
        name = function.get_str("name")
        if not name:
            raise InvalidArgumentError(f"{where}.tool_calls[{i}].function.name is required")
        arguments = function.raw("arguments")
        if not isinstance(arguments, str):  # OpenAI sends JSON text; an object is taken as it is
            arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
        calls.append(ToolCall(call.get_str("id") or "", name, arguments))
    return tuple(calls)


def _message_content(message: JsonObject, role: str, where: str) -> ChatMessage:
    content = message.raw("content")
    if content is None or isinstance(content, str):
        return ChatMessage(role, content or "")
    if not isinstance(content, list):
        raise InvalidArgumentError(f"{where}.content must be a string or a list of parts, got {type_name(content)}")
    texts, images = [], []
    for j, part_value in enumerate(content):
        part = JsonObject(part_value, f"{where}.content[{j}]")
        kind = part.get_str("type")
        if kind == "image_url":
            images.append(_image_url(part, f"{where}.content[{j}].image_url"))
            texts.append(IMAGE_MARKER)
            continue
        if kind != "text":
            raise InvalidArgumentError(f"{where}.content[{j}]: part type {quote(kind or '')} is not supported; "
                                       "only 'text' and 'image_url'")
        texts.append(part.get_str("text") or "")
    return ChatMessage(role, "".join(texts), tuple(images))


def _image_url(part: JsonObject, where: str) -> str:
    """An image_url part's URL: {"url": "..."} (OpenAI), or the URL string itself."""
    value = part.raw("image_url")
    url = value if isinstance(value, str) else JsonObject(value, where).get_str("url")
    if not url:
        raise InvalidArgumentError(f"{where}.url is required")
    return url
