"""Stream chunks encoded from a choice's template are the bytes of the whole chunk dict's JSON."""

from __future__ import annotations

import copy
import json

import pytest

from services.frontend.messages import GenerateChunk, PositionLogprobs, TokenLogprob
from services.frontend.openai_format import ChatFormatter, CompletionFormatter, ResponseFormatter, dumps_json
from services.frontend.tool_parsers import ToolCallFormat
from services.frontend.tools import parse_tools

TEXTS = ["hello", " ", "", 'a "quoted" \\ back\nslash\t', "naïve ☃ 😀", "\u2028\x00\x1f", "}]},{", "\x00spindle"]


def _formatters() -> list[tuple[str, ResponseFormatter]]:
    made: list[tuple[str, ResponseFormatter]] = []
    for cls in (CompletionFormatter, ChatFormatter):
        for include_usage in (False, True):
            for fingerprint in (None, 'fp "1"'):
                made.append((f"{cls.__name__} usage={include_usage} fp={fingerprint}",
                             cls("id-1", 'model "m"\n', str, include_usage, fingerprint, False, 7)))
        made.append((f"{cls.__name__} continuous usage", cls("id-2", "m", str, True, None, True, 7)))
    return made


def _same_chunks(formatter: ResponseFormatter, chunks: list[GenerateChunk]) -> None:
    """chunk_json of each chunk is dumps_json of chunk() on a twin fed the same chunks."""
    twin = copy.deepcopy(formatter)
    for chunk in chunks:
        assert formatter.chunk_json(chunk) == dumps_json(twin.chunk(chunk)), chunk


@pytest.mark.parametrize(("name", "formatter"), _formatters())
def test_chunk_json_is_the_chunk_dict_encoded(name: str, formatter: ResponseFormatter) -> None:
    _same_chunks(formatter, [GenerateChunk("r", [i], text, index=i % 3, is_prompt=i == 0)
                             for i, text in enumerate(TEXTS * 2)])
    templates = list(formatter._templates.values())
    assert templates == [] if formatter.continuous_usage else len(templates) == 3 and None not in templates


def test_chunks_with_logprobs_or_tool_reading_take_the_dict_path() -> None:
    logprobs = [PositionLogprobs(TokenLogprob(5, -0.5), [TokenLogprob(5, -0.5), TokenLogprob(6, -1.5)])]
    completion = CompletionFormatter("id", "m", str)
    _same_chunks(completion, [GenerateChunk("r", [4], "four"), GenerateChunk("r", [5], "five", logprobs=logprobs),
                              GenerateChunk("r", [6], "six")])  # text offsets count every chunk's text
    assert json.loads(completion.chunk_json(GenerateChunk("r", [5], "5", logprobs=logprobs)))[
        "choices"][0]["logprobs"]["text_offset"] == [len("fourfivesix")]

    chat = ChatFormatter("id", "m", str)
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}], None, None)
    assert tools is not None
    chat.read_tool_calls(tools, ToolCallFormat.HERMES)
    _same_chunks(chat, [GenerateChunk("r", [1], "plain words"), GenerateChunk("r", [2], " <tool_call>")])
    assert chat._templates == {0: None}  # a tool reader's text has no fixed form
