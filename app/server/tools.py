"""OpenAI function calling on the local server: ``tools``, ``tool_choice``, tool results.

The request's fields are checked here (400s naming the field); the prompt, the grammar of
calls and the reply's splitting are shared with the app's chats in app/core/tool_calls.py.
"""

from __future__ import annotations

from app.core.tool_calls import (  # noqa: F401  (the server's names for the shared logic)
    COMMON_END,
    COMMON_FORMAT_HINT,
    COMMON_START,
    NAME,
    CallSplitter,
    CallSyntax,
    ToolUse,
    call_constraint,
    openai_call,
    tool_messages,
    with_tool_hint,
)
from app.server.errors import APIError


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
