"""Function calling, shared by the local server (app/server) and the app's chats (MCP tools):
the prompt with tools, the grammar of a required call, and the splitting of a reply into
content and calls. Qt-free.

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

from engine import Constraint, ToolCallFormat

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
COMMON_START, COMMON_END = "<tool_call>", "</tool_call>"
CALL_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
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
    body = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    # JSON written as json.dumps writes it: llguidance's %json otherwise admits any run of
    # spaces, tabs and newlines between tokens, and a sampled small model under a repetition
    # penalty (the app's defaults) can fill its whole token budget with them and never close
    # the call (CI's walk-through: a reply cut after 1,600 characters of tabs)
    body["x-guidance"] = CALL_JSON_LAYOUT
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


@dataclass
class ToolPrompt:
    """A chat's prompt tokens and how its reply writes tool calls (None: not parsed)."""

    tokens: list[int]
    syntax: CallSyntax | None = None


def chat_prompt(engine: Any, messages: list[dict], raw: list, use: ToolUse | None) -> ToolPrompt:
    """The chat's prompt with its tools: through the model's own template and call format
    when it has both, else described in the common format. ``raw`` holds the OpenAI-shaped
    messages (``tool_calls``, ``tool_call_id``) that ``messages`` were made from. Tokenises:
    call it off the GUI thread and off the server's loop."""
    fmt = engine.tool_call_format()
    native = fmt is not None and (use is None or engine.encode_chat(
        messages, tools=use.tools) != engine.encode_chat(messages))
    messages = tool_messages(messages, raw, native)
    if use is None or use.choice == "none":
        return ToolPrompt(engine.encode_chat(messages))
    if native:
        tokens = engine.encode_chat(messages, tools=use.tools)
        syntax = CallSyntax(fmt.start, fmt.end, fmt)
    else:
        tokens = engine.encode_chat(with_tool_hint(messages, use))
        syntax = CallSyntax(COMMON_START, COMMON_END, None)
    if use.forced:  # the grammar writes JSON calls between the common markers
        syntax = CallSyntax(COMMON_START, COMMON_END, None)
    return ToolPrompt(tokens, syntax)
