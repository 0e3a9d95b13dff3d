"""MCP servers for the tests, written with the official SDK (``MCPServer``, formerly
FastMCP) into script files that run over stdio with ``sys.executable``."""

from __future__ import annotations

import sys
from pathlib import Path

from app.core.mcp import McpServer

# add: a plain tool; lookup: a result with a word to search for; fails: the tool's own
# error; dies: the process exits mid-call; hangs: never answers.
TOOLS_SCRIPT = '''
import os, sys, time
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("test tools")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return f"sum is {a + b} (zanzibar)"


@server.tool()
def fails(reason: str) -> str:
    """Always fails."""
    raise ToolError(f"refused on purpose: {reason}")


@server.tool()
def dies() -> str:
    """Exits the server mid-call."""
    print("dying on purpose", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool()
def hangs() -> str:
    """Never answers."""
    time.sleep(3600)
    return "never"


server.run()
'''

# one tool per server, for the chat tests: the model can only call that one (a short city:
# the grammar of a required call keeps the small model's argument short)
SINGLE_SCRIPT = '''
import os, sys, time
from typing import Annotated

from pydantic import Field
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("single")
BEHAVIOUR = {behaviour!r}


@server.tool()
def {name}(city: Annotated[str, Field(max_length=20)]) -> str:
    """The weather in a city."""
    if BEHAVIOUR == "error":
        raise ToolError("the weather service is down")
    if BEHAVIOUR == "crash":
        print("weather server crashed", file=sys.stderr, flush=True)
        os._exit(3)
    if BEHAVIOUR == "hang":
        time.sleep(3600)
    return "sunny and 31 degrees, zanzibar weather"


server.run()
'''

CRASH_AT_START = 'import sys\nsys.exit("cannot start: missing configuration")\n'


def write_tools_server(folder: Path) -> Path:
    path = folder / "tools_server.py"
    path.write_text(TOOLS_SCRIPT, encoding="utf-8")
    return path


def write_single_server(folder: Path, behaviour: str = "ok", name: str = "weather") -> Path:
    path = folder / f"{name}_{behaviour}_server.py"
    path.write_text(SINGLE_SCRIPT.format(behaviour=behaviour, name=name), encoding="utf-8")
    return path


def write_crash_at_start(folder: Path) -> Path:
    path = folder / "crash_server.py"
    path.write_text(CRASH_AT_START, encoding="utf-8")
    return path


def stdio_server(path: Path, name: str = "test tools") -> McpServer:
    return McpServer(id=path.stem, name=name, command=sys.executable, args=[str(path)])


HTTP_SCRIPT = '''
import sys
from mcp.server.mcpserver import MCPServer

server = MCPServer("http tools")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return f"sum is {a + b}"


server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
'''


def write_http_server(folder: Path) -> Path:
    path = folder / "http_server.py"
    path.write_text(HTTP_SCRIPT, encoding="utf-8")
    return path
