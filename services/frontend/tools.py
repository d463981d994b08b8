"""OpenAI function calling, request side: `tools` and `tool_choice` -> what the prompt and grammar get.

    tools:       [{"type": "function", "function": {"name", "description"?, "parameters"?}}, ...]
    tool_choice: "none" | "auto" (default with tools) | "required" | {"type": "function", "function": {"name"}}

With "auto" the model decides, in its chat template's own tool-call format, which
`tool_parsers.py` reads back. "required" and a named function are enforced with the grammar
engine, as vLLM does it: the output is constrained to a JSON array of
{"name", "parameters"} calls (required) or to the named function's arguments object, so every
answer is a well-formed call whatever the model. "none" renders no tools and parses nothing.

A chat template that knows no tools (Phi-3, Gemma 2 and the tiny test models) gets them
described in the system message (or ahead of the first turn), with the hermes format (`<tool_call>{...}</tool_call>`)
that `tool_parsers.py` then reads; assistant tool calls and tool results of earlier turns are
written in that format too, as user turns, so any template can render them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from services.frontend.messages import ChatMessage
from shared.errors import InvalidArgumentError
from shared.grammar import Grammar, GrammarKind

MAX_TOOLS = 128  # OpenAI's own limit
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CHOICES = ("none", "auto", "required")


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, object]  # a JSON schema of the arguments object

    def to_openai(self) -> dict[str, object]:
        function: dict[str, object] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(slots=True, frozen=True)
class ToolRequest:
    """A chat request's tools and how the model must use them."""

    tools: tuple[Tool, ...]
    choice: str  # "none", "auto", "required" or "function" (a named function: `function`)
    function: str = ""
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def is_active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    def grammar(self) -> Grammar | None:
        """The output grammar of a forced choice; None when the model decides (auto, none)."""
        if self.choice == "function":
            tool = next(t for t in self.tools if t.name == self.function)
            return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(tool.parameters, ensure_ascii=False))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, object] = {"type": "array", "minItems": 1,
                                     "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))


def parse_tools(tools_value: object, choice_value: object, parallel_value: object) -> ToolRequest | None:
    """The request's tools; None when it has none. A malformed field is a 400 naming it."""
    if parallel_value is not None and not isinstance(parallel_value, bool):
        raise InvalidArgumentError("parallel_tool_calls must be a boolean")
    if tools_value is None or tools_value == []:
        if choice_value not in (None, "none"):
            raise InvalidArgumentError("tool_choice needs tools: the request defines none")
        return None
    if not isinstance(tools_value, list):
        raise InvalidArgumentError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    if len(tools_value) > MAX_TOOLS:
        raise InvalidArgumentError(f"tools holds {len(tools_value)} tools; at most {MAX_TOOLS} are allowed")
    tools = tuple(_tool(value, i) for i, value in enumerate(tools_value))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise InvalidArgumentError(f"tools defines the function {duplicate!r} more than once")
    choice, function = _choice(choice_value, names)
    return ToolRequest(tools, choice, function, parallel_value is not False)


def _tool(value: object, index: int) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise InvalidArgumentError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    function = value["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgumentError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidArgumentError(f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidArgumentError(f"{where}.function.parameters must be a JSON schema object")
    return Tool(name, description, parameters)


def _choice(value: object, names: list[str]) -> tuple[str, str]:
    if value is None:
        return "auto", ""
    if isinstance(value, str):
        if value not in _CHOICES:
            raise InvalidArgumentError(f"tool_choice {value[:40]!r} is not supported; use one of "
                                       f"{', '.join(_CHOICES)} or {{\"type\": \"function\", \"function\": "
                                       "{\"name\": ...}}")
        return value, ""
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise InvalidArgumentError("tool_choice must be a string or {\"type\": \"function\", \"function\": "
                                   "{\"name\": ...}}")
    if name not in names:
        raise InvalidArgumentError(f"tool_choice names the function {name[:64]!r}, which tools does not define")
    return "function", name


# ---- prompt -------------------------------------------------------------------------------

_GENERIC_INSTRUCTIONS = (
    "You can call the functions below. To call one, answer with\n"
    "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call>\n"
    "(one block per call). Functions:\n"
)


def template_knows_tools(chat_template: str) -> bool:
    """Whether the template renders a `tools` list itself (Llama 3.1+, Qwen2.5+, Mistral, Hermes)."""
    return "tools" in chat_template


def hermes_call_text(name: str, arguments: str) -> str:
    """One call in the hermes format the generic prompt teaches."""
    return f"<tool_call>\n{{\"name\": {json.dumps(name)}, \"arguments\": {arguments or '{}'}}}\n</tool_call>"


def generic_messages(messages: list[ChatMessage], tools: ToolRequest | None) -> list[ChatMessage]:
    """`messages` for a template that knows no tools: tools described in the system message,
    earlier calls and results written as text (see the module docstring)."""
    out = []
    for message in messages:
        if message.tool_calls:
            calls = "\n".join(hermes_call_text(c.name, c.arguments) for c in message.tool_calls)
            message = replace(message, content="\n".join(filter(None, (message.content, calls))), tool_calls=())
        elif message.role == "tool":
            message = replace(message, role="user", content=f"<tool_response>\n{message.content}\n</tool_response>",
                              tool_call_id="")
        out.append(message)
    if tools is None or not tools.is_active:
        return out
    described = _GENERIC_INSTRUCTIONS + "\n".join(json.dumps(t.to_openai()["function"], ensure_ascii=False)
                                                  for t in tools.tools)
    if not out:
        return [ChatMessage("system", described)]
    # Into the system message, or ahead of the first turn: some templates (Gemma) refuse a system role.
    first = out[0]
    out[0] = replace(first, content=f"{first.content}\n\n{described}" if first.role == "system" and first.content
                     else described if first.role == "system" else f"{described}\n\n{first.content}")
    return out
