"""Function calling through the official `openai` client and the real services.

The tiny random model never calls a tool by itself, so every call here is the grammar's doing
(tool_choice required / named) or, for auto, a `structured_outputs` regex that makes the model
write a call in the hermes format the generic prompt teaches; the frontend must read it back
whole and streamed. Arguments always validate against the function's schema.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.server import StandaloneServices, spindle_services

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def svc(tiny_models: dict[str, Path]) -> Iterator[StandaloneServices]:
    with spindle_services(tiny_models["llama"], scheduler_args=("--num-scheduler-steps", "4")) as running:
        yield running


@pytest.fixture(scope="module")
def client(svc: StandaloneServices) -> OpenAI:
    return OpenAI(base_url=svc.server.http_url + "/v1", api_key="unused", max_retries=0)


def _validate(name: str, arguments: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed_calls(stream: openai.Stream) -> tuple[dict[int, list[dict]], dict[int, str | None], str]:
    """Per choice: the calls rebuilt from the deltas, the finish reason; and all content."""
    calls: dict[int, list[dict]] = {}
    finishes: dict[int, str | None] = {}
    content = ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entries = calls.setdefault(choice.index, [])
                if delta.id is not None:
                    assert delta.index == len(entries) and delta.type == "function"
                    entries.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                entries[delta.index]["arguments"] += delta.function.arguments or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    return calls, finishes, content


def test_required_makes_every_choice_a_valid_call_whole_and_streamed(svc: StandaloneServices, client: OpenAI) -> None:
    model = svc.server.model_name
    chat = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=3,
                                          temperature=1.0, max_tokens=120, seed=5)
    for choice in chat.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            _validate(call.function.name, call.function.arguments)
    calls, finishes, content = _streamed_calls(client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, max_tokens=120,
        seed=5, stream=True, parallel_tool_calls=False))
    assert finishes == {0: "tool_calls"} and content == "" and len(calls[0]) == 1
    _validate(calls[0][0]["name"], calls[0][0]["arguments"])


def test_a_named_function_streams_its_arguments_and_equals_the_whole_answer(svc: StandaloneServices,
                                                                            client: OpenAI) -> None:
    model = svc.server.model_name
    named = {"type": "function", "function": {"name": "add"}}
    chat = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                          temperature=0.0, max_tokens=60)
    (call,) = chat.choices[0].message.tool_calls
    assert call.function.name == "add" and chat.choices[0].finish_reason == "stop"
    _validate("add", call.function.arguments)
    calls, finishes, _ = _streamed_calls(client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named, temperature=0.0, max_tokens=60, stream=True))
    assert finishes == {0: "stop"}
    assert [(c["name"], c["arguments"]) for c in calls[0]] == [("add", call.function.arguments)]


def test_auto_reads_a_call_the_model_writes_in_its_format_and_plain_text_stays_content(
        svc: StandaloneServices, client: OpenAI) -> None:
    model = svc.server.model_name
    written = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
               "</tool_call>")
    regex = {"structured_outputs": {"regex": written.replace(".", r"\.").replace("{", r"\{").replace("}", r"\}")}}
    chat = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0.0,
                                          max_tokens=200, extra_body=regex)
    message = chat.choices[0].message
    assert message.content == "Checking." and chat.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    calls, finishes, content = _streamed_calls(client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=200, extra_body=regex, stream=True))
    assert content == "Checking." and finishes == {0: "tool_calls"}
    assert [(c["name"], json.loads(c["arguments"])) for c in calls[0]] == [("get_weather", {"city": "Oslo",
                                                                                           "unit": "celsius"})]
    # No call in the text: all of it is content, finish reason as usual; the tools were in the prompt.
    plain = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=8,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"
    bare = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0.0, max_tokens=8,
                                          extra_body={"ignore_eos": True})
    assert plain.usage.prompt_tokens > bare.usage.prompt_tokens + 50
    off = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True})
    assert off.usage.prompt_tokens == bare.usage.prompt_tokens and off.choices[0].message.content == \
        bare.choices[0].message.content


def test_a_conversation_with_earlier_calls_and_results_continues(svc: StandaloneServices, client: OpenAI) -> None:
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    chat = client.chat.completions.create(model=svc.server.model_name, messages=messages, tools=TOOLS,
                                          temperature=0.0, max_tokens=6, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6


BAD_TOOLS = [
    ({"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "more than once"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "does not define"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}], "tool_choice": "required"}, "json_schema"),
]


def test_bad_tools_are_a_clear_400_while_a_forced_call_runs_on(svc: StandaloneServices) -> None:
    model = svc.server.model_name

    async def run() -> None:
        async with AsyncOpenAI(base_url=svc.server.http_url + "/v1", api_key="unused", max_retries=0) as aclient:
            bystander = asyncio.ensure_future(aclient.chat.completions.create(
                model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
                max_tokens=120, seed=9))
            await asyncio.sleep(0.05)
            for fields, message in BAD_TOOLS:
                with pytest.raises(openai.BadRequestError) as info:
                    await aclient.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **fields)
                assert message in str(info.value), fields
            result = await bystander
            assert result.choices[0].finish_reason == "tool_calls"
            for call in result.choices[0].message.tool_calls:
                _validate(call.function.name, call.function.arguments)

    asyncio.run(run())
