"""MCP servers for the app's chats: the user's list of servers, their tools, and tool calls.

A server is either a command started with its arguments (stdio) or a streamable-HTTP URL,
with an optional bearer key kept in the OS keychain only (app.core.secrets): the list in the
app database holds names, commands and URLs, never a key.

Every MCP operation runs on a private asyncio loop in a thread of its own (``McpClient``),
through the official ``mcp`` SDK. The GUI awaits it (``asyncio.wrap_future``) and never
blocks; a server that floods, hangs or dies can stall only its own operation, which ends at
its timeout. Each operation opens its own connection (start, initialize, list or call,
close): a server that crashed is simply started again by the next call, and one call's
broken session never wedges the next. Failures come back as one line that names the server
and says what happened (could not start, exited, no answer in N s, the tool's own error).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import tempfile
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from app.core import secrets
from app.core.records import new_id
from app.core.serial import from_json, to_json

SETTINGS_KEY = "mcp_servers"
TIMEOUT_KEY = "mcp_timeout_s"
DEFAULT_TIMEOUT_S = 20.0
MAX_RESULT_CHARS = 20_000  # a result longer than this is cut (it goes into the prompt)
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclass
class McpServer:
    """One server: ``command`` + ``args`` (stdio) or ``url`` (streamable HTTP)."""

    id: str = ""
    name: str = ""
    command: str = ""
    args: list[str] = field(default_factory=list)
    url: str = ""
    enabled: bool = True
    always_allowed: list[str] = field(default_factory=list)  # tools run without asking

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    @property
    def key_user(self) -> str:
        """The keychain entry of its bearer key."""
        return f"mcp:{self.id}"

    def describe(self) -> str:
        if self.url:
            return self.url
        return " ".join([self.command, *self.args])

    def to_dict(self) -> dict[str, Any]:
        return to_json(self)

    @classmethod
    def from_dict(cls, data: Any) -> McpServer:
        server = from_json(cls, data)
        args = data.get("args") if isinstance(data, dict) else None
        if isinstance(args, list):  # a list of strings (the generic loader keeps scalars)
            server.args = [str(a) for a in args]
        allowed = data.get("always_allowed") if isinstance(data, dict) else None
        if isinstance(allowed, list):
            server.always_allowed = [str(a) for a in allowed]
        return server


@dataclass(frozen=True)
class McpTool:
    """A tool as its server lists it."""

    server_id: str
    server_name: str
    name: str
    description: str
    parameters: dict

    def spec(self, name: str) -> dict:
        """The OpenAI function tool the model sees, under ``name`` (unique in the chat)."""
        return {"type": "function", "function": {
            "name": name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolResult:
    """What a call gave back: the text the model reads, and whether it is an error."""

    text: str
    is_error: bool = False


class McpError(Exception):
    """An operation failed; ``str()`` is one line fit for the user (and the model)."""


def exposed_names(tools: list[McpTool]) -> dict[str, McpTool]:
    """The chat-wide names of the tools (letters, digits, ``_``, ``-``; at most 64): a tool's
    own name, or ``server_name`` where two servers list the same one."""
    seen: dict[str, int] = {}
    for t in tools:
        key = _UNSAFE.sub("_", t.name)[:64]
        seen[key] = seen.get(key, 0) + 1
    out: dict[str, McpTool] = {}
    for t in tools:
        name = _UNSAFE.sub("_", t.name)[:64] or "tool"
        if seen.get(name, 0) > 1 or name in out:
            name = _UNSAFE.sub("_", f"{t.server_name}_{t.name}")[:64]
        while name in out:
            name = name[:60] + "_" + new_id()[:3]
        out[name] = t
    return out


class McpServers:
    """The user's servers, kept in the app database (keys in the keychain), and the tools
    each listed last (this run only); listeners hear of every change."""

    def __init__(self, store: Any) -> None:
        self.store = store
        raw = store.get_value(SETTINGS_KEY) if store is not None else None
        self._servers: dict[str, McpServer] = {}
        for item in raw if isinstance(raw, list) else []:
            server = McpServer.from_dict(item)
            if server.id:
                self._servers[server.id] = server
        self.tools: dict[str, list[McpTool]] = {}  # server id -> tools it listed last
        self.errors: dict[str, str] = {}  # server id -> why its last listing failed
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def servers(self) -> list[McpServer]:
        return list(self._servers.values())

    def get(self, server_id: str) -> McpServer | None:
        return self._servers.get(server_id)

    def key(self, server: McpServer) -> str | None:
        return secrets.get_secret(server.key_user) if server.url else None

    def add(self, name: str, command: str = "", args: list[str] | None = None, url: str = "",
            key: str | None = None, enabled: bool = True) -> McpServer:
        """A new server; raises ValueError with a message for the user on bad input."""
        name, command = self._checked(name, command, url)
        url = url.strip()
        server = McpServer(new_id(), name, "" if url else command,
                           [] if url else list(args or []), url, enabled)
        if key and server.url:
            secrets.set_secret(server.key_user, key)
        self._servers[server.id] = server
        self._save()
        return server

    def update(self, server_id: str, name: str, command: str = "",
               args: list[str] | None = None, url: str = "", key: str | None = None,
               enabled: bool = True) -> McpServer:
        """Change a server; ``key`` None keeps the stored key, "" deletes it."""
        server = self._servers[server_id]
        server.name, _ = self._checked(name, command, url)
        server.url = url.strip()
        server.command = "" if server.url else command.strip()
        server.args = [] if server.url else list(args or [])
        server.enabled = enabled
        if key is not None or not server.url:
            secrets.set_secret(server.key_user, key if server.url else None)
        self.tools.pop(server_id, None)  # another command or URL: list again
        self.errors.pop(server_id, None)
        self._save()
        return server

    def set_enabled(self, server_id: str, enabled: bool) -> None:
        if server_id in self._servers:
            self._servers[server_id].enabled = enabled
            self._save()

    def remove(self, server_id: str) -> None:
        server = self._servers.pop(server_id, None)
        if server is not None:
            secrets.set_secret(server.key_user, None)
            self.tools.pop(server_id, None)
            self.errors.pop(server_id, None)
            self._save()

    def set_tools(self, server_id: str, tools: list[McpTool] | None, error: str = "") -> None:
        """What listing the server gave: its tools, or (None) the error instead."""
        if tools is None:
            self.tools.pop(server_id, None)
            self.errors[server_id] = error
        else:
            self.tools[server_id] = list(tools)
            self.errors.pop(server_id, None)
        self._notify()

    @staticmethod
    def _checked(name: str, command: str, url: str) -> tuple[str, str]:
        name = " ".join(name.split())
        if not name:
            raise ValueError("Give the server a name.")
        url = url.strip()
        if url and not url.startswith(("http://", "https://")):
            raise ValueError("The URL must start with http:// or https://.")
        if not url and not command.strip():
            raise ValueError("Give a command to start the server (stdio) or its URL (HTTP).")
        return name, command.strip()

    def _save(self) -> None:
        if self.store is not None:
            self.store.set_value(SETTINGS_KEY, [s.to_dict() for s in self._servers.values()])
        self._notify()

    def _notify(self) -> None:
        for fn in list(self._listeners):
            fn()


class McpClient:
    """MCP operations on a private loop in a thread of their own (see the module's doc).

    The coroutines here may be awaited from any asyncio loop (the GUI's qasync loop): the
    work runs on the private loop and the caller only waits for its future. Cancelling the
    caller's await cancels the operation (and stops its server process).
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    async def list_tools(self, server: McpServer, key: str | None = None) -> list[McpTool]:
        """The server's tools; raises McpError."""
        return await self._run(self._guarded(server, key, None, None, self.timeout_s))

    async def call_tool(self, server: McpServer, name: str, arguments: dict,
                        key: str | None = None, timeout_s: float | None = None) -> ToolResult:
        """Call one tool. A tool's own error comes back as a ToolResult with ``is_error``;
        a server that cannot be reached, exits or does not answer in time raises McpError."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        return await self._run(self._guarded(server, key, name, arguments, limit))

    def close(self) -> None:
        """Stop the private loop (operations in flight are cancelled with it)."""
        with self._lock:
            loop, self._loop = self._loop, None
            thread, self._thread = self._thread, None
        if loop is not None:
            # Only the loop's own thread may walk its tasks: it cancels them once stopped.
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=5)

    # ---- the private loop ----------------------------------------------------------------

    async def _run(self, coro: Coroutine) -> Any:
        loop = self._private_loop()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    def _private_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()
                    # stopped by close(): operations in flight are cancelled and let unwind
                    # (their servers' processes are ended by their context managers)
                    pending = asyncio.all_tasks(loop)
                    for task in pending:
                        task.cancel()
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                    loop.close()

                self._thread = threading.Thread(target=serve, name="mcp-client", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
            return self._loop

    async def _guarded(self, server: McpServer, key: str | None, name: str | None,
                       arguments: dict | None, timeout_s: float) -> Any:
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
            try:
                return await asyncio.wait_for(
                    self._operate(server, key, name, arguments, errlog), timeout_s)
            except TimeoutError:
                raise McpError(f"{server.name}: no answer in {timeout_s:g} s (the server hangs"
                               " or is too slow)") from None
            except McpError:
                raise
            except Exception as exc:
                raise McpError(_describe(server, exc, _last_line(errlog))) from None

    async def _operate(self, server: McpServer, key: str | None, name: str | None,
                       arguments: dict | None, errlog: Any) -> Any:
        from mcp.client.session import ClientSession

        async with contextlib.AsyncExitStack() as stack:
            if server.url:
                from mcp.client.streamable_http import streamable_http_client
                from mcp.shared._httpx_utils import create_mcp_http_client

                headers = {"Authorization": f"Bearer {key}"} if key else None
                http = await stack.enter_async_context(create_mcp_http_client(headers=headers))
                read, write = await stack.enter_async_context(
                    streamable_http_client(server.url, http_client=http))
            else:
                from mcp.client.stdio import StdioServerParameters, stdio_client

                params = StdioServerParameters(command=server.command, args=list(server.args))
                read, write = await stack.enter_async_context(stdio_client(params, errlog))
            session = await stack.enter_async_context(ClientSession(read, write))
            await session.initialize()
            if name is None:
                listed = await session.list_tools()
                return [McpTool(server.id, server.name, t.name, t.description or "",
                                dict(t.input_schema or {"type": "object", "properties": {}}))
                        for t in listed.tools]
            result = await session.call_tool(name, arguments or {})
            return ToolResult(_result_text(result), bool(getattr(result, "is_error", False)))


def _result_text(result: Any) -> str:
    """A call's content as text: its text parts, else its structured content as JSON."""
    parts = []
    for item in getattr(result, "content", None) or []:
        text = getattr(item, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(item, 'type', 'content')}]")
    text = "\n".join(parts)
    structured = getattr(result, "structured_content", None)
    if not text and structured is not None:
        text = json.dumps(structured, ensure_ascii=False)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n[cut: {len(text)} characters in all]"
    return text


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups: the SDK's task groups wrap them."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _describe(server: McpServer, exc: BaseException, stderr: str) -> str:
    leaf = _leaves(exc)[0]
    said = f" (it said: {stderr})" if stderr else ""
    if isinstance(leaf, FileNotFoundError | PermissionError) and server.transport == "stdio":
        return f"{server.name}: could not start {server.command!r}: {leaf.strerror or leaf}"
    text = str(leaf).strip().splitlines()[0] if str(leaf).strip() else type(leaf).__name__
    if "Connection closed" in text or isinstance(leaf, EOFError | BrokenPipeError):
        if server.transport == "stdio":
            return f"{server.name}: the server exited{said or ' (closed the connection)'}"
        return f"{server.name}: the server closed the connection"
    return f"{server.name}: {type(leaf).__name__}: {text}{said}"


def _last_line(errlog: Any) -> str:
    """The last line the server wrote to stderr (why it crashed, most often)."""
    with contextlib.suppress(OSError, ValueError):
        errlog.flush()
        errlog.seek(0)
        lines = [line.strip() for line in errlog.read()[-4000:].splitlines() if line.strip()]
        return lines[-1][:200] if lines else ""
    return ""


class McpHub:
    """The app's MCP side for its chats: the servers, the client, the tools a chat sees,
    what the user allowed for good. Qt-free; every coroutine here may be awaited on the GUI
    loop (the work runs on the client's own loop)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.servers = McpServers(store)
        stored = store.get_value(TIMEOUT_KEY) if store is not None else None
        timeout = float(stored) if isinstance(stored, int | float) and stored > 0 else None
        self.client = McpClient(timeout or DEFAULT_TIMEOUT_S)

    @property
    def timeout_s(self) -> float:
        return self.client.timeout_s

    def set_timeout(self, seconds: float) -> None:
        """How long a server may take to list or to answer a call before it counts as hung."""
        self.client.timeout_s = max(0.5, float(seconds))
        if self.store is not None:
            self.store.set_value(TIMEOUT_KEY, self.client.timeout_s)

    async def refresh(self, server: McpServer) -> list[McpTool]:
        """List the server's tools again (kept for the chats); raises McpError."""
        try:
            tools = await self.client.list_tools(server, self.servers.key(server))
        except McpError as exc:
            self.servers.set_tools(server.id, None, str(exc))
            raise
        self.servers.set_tools(server.id, tools)
        return tools

    async def chat_tools(self) -> tuple[dict[str, McpTool], list[str]]:
        """The tools of the enabled servers under their chat-wide names, listing the servers
        not listed yet this run (together); and the errors of those that failed."""
        enabled = [s for s in self.servers.servers() if s.enabled]
        missing = [s for s in enabled if s.id not in self.servers.tools]
        results = await asyncio.gather(*(self.refresh(s) for s in missing),
                                       return_exceptions=True)
        errors = [str(r) for r in results if isinstance(r, BaseException)]
        tools = [t for s in enabled for t in self.servers.tools.get(s.id, [])]
        return exposed_names(tools), errors

    async def call(self, tool: McpTool, arguments: dict) -> ToolResult:
        """Call ``tool``; raises McpError (the server is gone, failed or does not answer)."""
        server = self.servers.get(tool.server_id)
        if server is None:
            raise McpError(f"{tool.server_name}: this server was removed")
        return await self.client.call_tool(server, tool.name, arguments, self.servers.key(server))

    def always_allowed(self, tool: McpTool) -> bool:
        server = self.servers.get(tool.server_id)
        return server is not None and tool.name in server.always_allowed

    def allow_always(self, tool: McpTool) -> None:
        server = self.servers.get(tool.server_id)
        if server is not None and tool.name not in server.always_allowed:
            server.always_allowed.append(tool.name)
            self.servers._save()

    def close(self) -> None:
        self.client.close()
