"""OpenAI function calling on the local server: ``tools``, ``tool_choice``, tool results.

The prompt. A model whose chat template renders tools, and whose call format mlx-lm knows
(``Engine.tool_call_format``: Qwen, Hermes, Llama, Mistral, ...), gets the tools and the
conversation's calls and results through its own template. Any other model (the default
SmolLM2 among them) is told about the tools in a system message, in the common JSON format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), and earlier calls and results
are written in that format.

The reply. ``auto``: the model may call; its text is split into calls (parsed with the
model's own parser, or as JSON in the common format) and content. ``required`` or a named
function: the engine holds the reply to a grammar of one or more calls (one when
``parallel_tool_calls`` is false), each an object with a tool's name and arguments valid under
its parameters schema, so even a model that has never seen a tool returns a valid call.
``none``: tools are neither shown nor parsed.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from app.server.errors import APIError
from engine import Constraint, ToolCallFormat

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
COMMON_START, COMMON_END = "<tool_call>", "</tool_call>"
COMMON_FORMAT_HINT = (
    "You can call functions to answer the user. They are described here:\n<tools>\n{specs}\n"
    "</tools>\nTo call one, reply with one block per call, exactly:\n<tool_call>\n"
    '{{"name": "<function name>", "arguments": {{<its arguments as JSON>}}}}\n</tool_call>\n'
    "A function's result comes back in <tool_response> tags; then answer the user."
)


@dataclass(frozen=True)
class ToolUse:
    """One request's tools and what it allows: ``choice`` is "auto", "required", "none" or
    the name of the function it must call."""

    tools: tuple[dict, ...]
    choice: str
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")


def parse_tools(body: dict) -> ToolUse | None:
    """The request's ``tools``/``tool_choice``/``parallel_tool_calls``, checked (400s name
    the field), or None when it has no tools."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice",
                           code="invalid_value")
        return None
    if not isinstance(raw, list):
        raise APIError(400, "tools must be a list of function tools", param="tools",
                       code="invalid_type")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": ...}}",
                           param=f"{where}.type", code="invalid_value")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function must be an object", param=f"{where}.function",
                           code="invalid_type")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, "
                           f"underscores or dashes, got {name!r}",
                           param=f"{where}.function.name", code="invalid_value")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON Schema object",
                           param=f"{where}.function.parameters", code="invalid_type")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise APIError(400, f"{where}.function.description must be a string",
                           param=f"{where}.function.description", code="invalid_type")
        tools.append({"type": "function", "function": {
            "name": name, "description": description, "parameters": parameters}})
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct names", param="tools",
                       code="invalid_value")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools "
                           f"({', '.join(names)})", param="tool_choice", code="invalid_value")
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise APIError(400, "tool_choice must be auto, none, required or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}, "
                       f"got {choice!r}", param="tool_choice", code="invalid_value")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be true or false",
                       param="parallel_tool_calls", code="invalid_type")
    return ToolUse(tuple(tools), choice, parallel)


def tool_messages(messages: list[dict], raw: list, native: bool) -> list[dict]:
    """The conversation with its tool calls and results, for the template: the OpenAI
    fields (``tool_calls`` with JSON-string arguments, ``tool_call_id``) as templates
    expect them when ``native``, else written in the common format as plain turns."""
    out = []
    for message, original in zip(messages, raw):
        calls = original.get("tool_calls") if isinstance(original, dict) else None
        role = message["role"]
        if native:
            m = dict(message)
            if calls:
                m["tool_calls"] = [_template_call(c) for c in calls]
            if role == "tool" and isinstance(original.get("tool_call_id"), str):
                m["tool_call_id"] = original["tool_call_id"]
            out.append(m)
            continue
        if role == "tool":
            out.append({"role": "user", "content":
                        f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif calls:
            blocks = "\n".join(
                f"{COMMON_START}\n{json.dumps(_template_call(c)['function'])}\n{COMMON_END}"
                for c in calls)
            text = f"{message['content']}\n{blocks}" if message["content"] else blocks
            out.append({"role": "assistant", "content": text})
        else:
            out.append(message)
    return out


def with_tool_hint(messages: list[dict], use: ToolUse) -> list[dict]:
    """The conversation with the tools described in a system message (the common format),
    for a model whose template does not render tools."""
    specs = "\n".join(json.dumps(t["function"]) for t in use.tools)
    hint = COMMON_FORMAT_HINT.format(specs=specs)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{hint}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": hint}, *messages]


def call_constraint(use: ToolUse, start: str, end: str) -> Constraint:
    """A grammar of tool calls for ``required`` or a named function: ``start`` JSON
    ``end`` blocks (several, newline-separated, when parallel), each JSON an object with one
    allowed tool's name and arguments valid under its parameters."""
    allowed = use.names if use.choice == "required" else [use.choice]
    options = [{"type": "object",
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": t["function"]["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in use.tools if t["function"]["name"] in allowed]
    body = options[0] if len(options) == 1 else {"anyOf": options}
    repeat = ' ("\\n" call)*' if use.parallel else ""
    lark = (f"start: call{repeat}\n"
            f"call: {json.dumps(start + chr(10))} body {json.dumps(chr(10) + end)}\n"
            f"body: %json {json.dumps(body)}\n")
    return Constraint("lark", lark)


@dataclass(frozen=True)
class CallSyntax:
    """How this request's reply writes calls: its markers, and how a call's text parses."""

    start: str
    end: str
    format: ToolCallFormat | None  # the model's own parser, or None: JSON

    def parse(self, text: str, tools: list) -> dict:
        if self.format is not None:
            return self.format.parse(text, tools)
        return json.loads(text)


def openai_call(parsed: Any) -> dict:
    """A parsed call as OpenAI's ``tool_calls`` entry (arguments as a JSON string)."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ValueError(f"not a call: {parsed!r}")
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": parsed["name"], "arguments": arguments}}


class CallSplitter:
    """Splits a reply's text, as it streams, into content and tool calls.

    ``feed(delta)`` returns the content that is safe to show (text that could still be the
    beginning of a call's start marker is held back) and the calls completed so far; a
    call whose text does not parse stays in the content, as the model wrote it.
    """

    def __init__(self, syntax: CallSyntax, tools: list) -> None:
        self.syntax = syntax
        self.tools = tools
        self._buffer = ""
        self._in_call = False
        self.calls: list[dict] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self._buffer += delta
        shown, done = [], []
        start, end = self.syntax.start, self.syntax.end
        while True:
            if not self._in_call:
                at = self._buffer.find(start)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, start)
                    shown.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                shown.append(self._buffer[:at])
                self._buffer = self._buffer[at + len(start):]
                self._in_call = True
            at = self._buffer.find(end) if end else -1
            if at < 0 and not final:
                break
            text = self._buffer if at < 0 else self._buffer[:at]
            self._buffer = "" if at < 0 else self._buffer[at + len(end):]
            self._in_call = False
            try:
                call = openai_call(self.syntax.parse(text.strip(), self.tools))
            except Exception:  # not a call after all: the text stays the model's words
                shown.append(f"{start}{text}{end if at >= 0 else ''}")
                continue
            self.calls.append(call)
            done.append(call)
            if at < 0:
                break
        return "".join(shown), done


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _template_call(call: Any) -> dict:
    """An OpenAI tool call as chat templates take it: arguments as an object."""
    if not isinstance(call, dict):
        return {"type": "function", "function": {"name": "", "arguments": {}}}
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # a template gets what it can render
            arguments = json.loads(arguments)
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function.get("name", ""), "arguments": arguments}}
