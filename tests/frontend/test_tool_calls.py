"""Function calling in the frontend: tools / tool_choice parsing, the forced grammars, the
generic prompt, each model format's reader (whole and split at every point), and the chat
formatter's tool-call deltas and finish reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.frontend.messages import ChatMessage, FinishReason, GenerateChunk, GenerateComplete, ToolCall, Usage
from services.frontend.openai_format import ChatFormatter, Choice
from services.frontend.openai_protocol import parse_chat
from services.frontend.tokenizer import Tokenizer
from services.frontend.tool_parsers import (
    JsonArrayReader,
    LeadingJsonReader,
    NamedFunctionReader,
    TaggedCallReader,
    ToolCallFormat,
    ToolCallReader,
    format_for_template,
)
from services.frontend.tools import ToolRequest, generic_messages, parse_tools
from shared.errors import InvalidArgumentError
from shared.grammar import GrammarKind

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _body(**fields: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_tools_parse_with_auto_as_the_default_and_forced_choices_get_a_grammar() -> None:
    auto = parse_chat(_body(tools=[WEATHER, TIME])).input
    assert auto.tools is not None and auto.tools.choice == "auto" and auto.sampling.grammar is None
    assert [t.name for t in auto.tools.tools] == ["get_weather", "get_time"]
    assert auto.tools.tools[1].parameters == {"type": "object", "properties": {}}

    named = parse_chat(_body(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                 "function": {"name": "get_weather"}})).input
    assert named.sampling.grammar is not None and named.sampling.grammar.kind is GrammarKind.JSON_SCHEMA
    assert json.loads(named.sampling.grammar.spec) == WEATHER["function"]["parameters"]

    required = parse_chat(_body(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)).input
    schema = json.loads(required.sampling.grammar.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]

    none = parse_chat(_body(tools=[WEATHER], tool_choice="none")).input
    assert none.tools is not None and not none.tools.is_active and none.sampling.grammar is None
    assert parse_chat(_body()).input.tools is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"tools": {"a": 1}}, "tools must be a list"),
    ({"tools": [{"type": "function"}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "parameters must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "description must be"),
    ({"tools": [TIME, TIME]}, "more than once"),
    ({"tools": [TIME] * 129}, "at most 128"),
    ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice 'sometimes' is not supported"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "does not define"),
    ({"tools": [TIME], "tool_choice": {"type": "function"}}, "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [TIME], "parallel_tool_calls": "yes"}, "parallel_tool_calls must be a boolean"),
    ({"tools": [TIME], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "assistant", "tool_calls": {"x": 1}}]}, "messages[0].tool_calls must be a list"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "function.name is required"),
])
def test_bad_tools_fields_are_clear_errors(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_chat(_body(**fields))


def test_earlier_tool_calls_and_results_are_read_from_the_messages() -> None:
    messages = parse_chat(_body(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])).input.messages
    assert messages[1].tool_calls == (ToolCall("call_1", "get_weather", "{\"city\": \"Oslo\"}"),)
    assert messages[1].to_template()["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2].tool_call_id == "call_1" and messages[2].to_template()["tool_call_id"] == "call_1"


def test_a_template_without_tools_gets_them_described_and_earlier_calls_as_text() -> None:
    tools = parse_tools([WEATHER], None, None)
    out = generic_messages([ChatMessage("user", "weather?"),
                            ChatMessage("assistant", "", tool_calls=(ToolCall("c", "get_weather", '{"city":"Oslo"}'),)),
                            ChatMessage("tool", "sunny", tool_call_id="c")], tools)
    assert out[0].role == "user" and "<tool_call>" in out[0].content and '"get_weather"' in out[0].content
    assert out[0].content.endswith("weather?")
    assert out[1].content == '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>'
    assert (out[2].role, out[2].content) == ("user", "<tool_response>\nsunny\n</tool_response>")
    with_system = generic_messages([ChatMessage("system", "Be brief."), ChatMessage("user", "q")], tools)
    assert with_system[0].content.startswith("Be brief.\n\n") and len(with_system) == 2
    off = generic_messages([ChatMessage("user", "q")], parse_tools([WEATHER], "none", None))
    assert off == [ChatMessage("user", "q")]


def test_a_template_that_knows_tools_renders_them_itself(tmp_path: Path, tokenizer_dir: Path) -> None:
    for file in tokenizer_dir.iterdir():
        if file.name != "chat_template.jinja":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                               "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}<tool_call>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(str(tmp_path))
    text = tokenizer._render_chat([ChatMessage("user", "hi")], tools=[WEATHER, TIME])
    assert text.startswith("TOOLS:get_weather;get_time;user: hi")
    assert format_for_template(tokenizer.chat_template) is ToolCallFormat.HERMES


def test_the_format_follows_the_template() -> None:
    assert format_for_template("{{ '[TOOL_CALLS]' }}") is ToolCallFormat.MISTRAL
    assert format_for_template("{{ '<|python_tag|>' }} ipython") is ToolCallFormat.LLAMA3_JSON
    assert format_for_template("<tool_call> {{ tools }}") is ToolCallFormat.HERMES
    assert format_for_template("{{ messages }}") is ToolCallFormat.HERMES


def _read(reader: ToolCallReader, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """Content, (name, arguments) calls, and the OpenAI call deltas of `pieces` fed in order."""
    content, deltas = "", []
    for piece in pieces:
        delta = reader.feed(piece)
        content += delta.content
        deltas += [c.to_openai() for c in delta.calls]
    last = reader.finish()
    content += last.content
    deltas += [c.to_openai() for c in last.calls]
    return content, [(c.name, c.arguments) for c in reader.calls], deltas


def _every_split(text: str) -> list[list[str]]:
    return [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]


@pytest.mark.parametrize(("make", "text", "content", "calls"), [
    (TaggedCallReader, 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (TaggedCallReader, "no calls, just a < and <tool", "no calls, just a < and <tool", []),
    (TaggedCallReader, "<tool_call>not json</tool_call>after", "<tool_call>not json</tool_call>after", []),
    (TaggedCallReader, '<tool_call>{"name": "f", "arguments": {"a": "</x>"}}', "", [("f", '{"a": "</x>"}')]),
    (lambda: LeadingJsonReader("<|python_tag|>", "{"),
     '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", '{"x": 1}'), ("g", "{}")]),
    (lambda: LeadingJsonReader("<|python_tag|>", "{"), ' {"name": "f", "parameters": {"x": 1}}', "",
     [("f", '{"x": 1}')]),
    (lambda: LeadingJsonReader("<|python_tag|>", "{"), "Plain answer {x}", "Plain answer {x}", []),
    (lambda: LeadingJsonReader("<|python_tag|>", "{"), '{"broken": ', '{"broken": ', []),
    (lambda: LeadingJsonReader("[TOOL_CALLS]", "["), '[TOOL_CALLS][{"name": "f", "arguments": {"q": "a]"}}]', "",
     [("f", '{"q": "a]"}')]),
    (JsonArrayReader, '[{"name":"get_weather","parameters":{"city":"Q\\"[}"}},{"name":"get_time","parameters":{}}]',
     "", [("get_weather", '{"city": "Q\\"[}"}'), ("get_time", "{}")]),
    (lambda: NamedFunctionReader("get_weather"), '{"city":"Rome"}', "", [("get_weather", '{"city":"Rome"}')]),
])
def test_readers_give_the_same_answer_however_the_text_is_split(make, text: str, content: str,  # noqa: ANN001
                                                                 calls: list[tuple[str, str]]) -> None:
    for pieces in _every_split(text):
        got_content, got_calls, deltas = _read(make(), pieces)
        assert (got_content, got_calls) == (content, calls), pieces
        # The deltas rebuild the calls: ids and names once, arguments concatenated.
        rebuilt: dict[int, dict] = {}
        for delta in deltas:
            entry = rebuilt.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in delta:
                assert entry["id"] is None and delta["id"].startswith("call_")
                entry["id"], entry["name"] = delta["id"], delta["function"]["name"]
            entry["arguments"] += delta["function"]["arguments"]
        assert [(e["name"], e["arguments"]) for _, e in sorted(rebuilt.items())] == calls


def _formatter(tools: ToolRequest) -> ChatFormatter:
    formatter = ChatFormatter("chatcmpl-1", "m", str)
    formatter.read_tool_calls(tools, ToolCallFormat.HERMES)
    return formatter


def _chunk(text: str, index: int = 0) -> GenerateChunk:
    return GenerateChunk("r", [1], text, index=index)


def test_the_chat_formatter_streams_call_deltas_and_finishes_with_tool_calls() -> None:
    tools = parse_tools([WEATHER], None, None)
    formatter = _formatter(tools)
    bodies = [formatter.chunk(_chunk(t)) for t in ("Sure. <tool", '_call>{"name": "get_weather", ',
                                                   '"arguments": {"city": "Oslo"}}</tool_call>')]
    deltas = [b["choices"][0]["delta"] for b in bodies]
    assert deltas[0] == {"content": "Sure. "} and deltas[1] == {"content": ""}
    assert deltas[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    end = formatter.end_chunk(GenerateComplete("r", FinishReason.STOP, Usage(3, 3)))
    assert end["choices"][0]["finish_reason"] == "tool_calls"

    whole = _formatter(tools).response([Choice(0, ['<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'],
                                               complete=GenerateComplete("r", FinishReason.STOP, Usage(3, 3)))],
                                       Usage(3, 3))
    message = whole["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert whole["choices"][0]["finish_reason"] == "tool_calls"

    plain = _formatter(tools).response([Choice(0, ["just text"], complete=GenerateComplete(
        "r", FinishReason.STOP, Usage(3, 3)))], Usage(3, 3))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "just text"}
    assert plain["choices"][0]["finish_reason"] == "stop"


def test_a_named_function_finishes_with_stop_as_openai_does() -> None:
    tools = parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    formatter = _formatter(tools)
    first = formatter.chunk(_chunk('{"city":'))["choices"][0]["delta"]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": '{"city":'} and first["id"].startswith("call_")
    later = formatter.chunk(_chunk('"Oslo"}'))["choices"][0]["delta"]["tool_calls"][0]
    assert later == {"index": 0, "function": {"arguments": '"Oslo"}'}}
    end = formatter.end_chunk(GenerateComplete("r", FinishReason.STOP, Usage(3, 3)))
    assert end["choices"][0]["finish_reason"] == "stop"
