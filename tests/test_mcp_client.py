"""The MCP client (app/core/mcp.py) against real MCP servers over stdio, written with the
official SDK: list, call, a tool's own error, a server that exits mid-call, one that never
answers (the timeout), one that cannot start; and the server list with its keychain key."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import subprocess
import sys
import time

import pytest

from app.core import secrets
from app.core.mcp import McpClient, McpError, McpServer, McpServers, McpTool, exposed_names
from app.core.records import Message
from app.core.search import MARK_START, TOOL_CALL_ROLE
from app.core.store import DB_NAME, Store
from tests.mcp_servers import (
    stdio_server,
    write_crash_at_start,
    write_http_server,
    write_tools_server,
)


@pytest.fixture
def client():
    c = McpClient(timeout_s=30)
    yield c
    c.close()


@pytest.fixture
def tools_server(tmp_path):
    return stdio_server(write_tools_server(tmp_path))


def run(coro):
    return asyncio.run(coro)


def test_lists_the_tools_with_their_schemas(client, tools_server):
    tools = run(client.list_tools(tools_server))
    by_name = {t.name: t for t in tools}
    assert set(by_name) == {"add", "fails", "dies", "hangs"}
    add = by_name["add"]
    assert add.description == "Add two integers."
    assert add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    assert add.server_id == tools_server.id


def test_calls_a_tool(client, tools_server):
    result = run(client.call_tool(tools_server, "add", {"a": 2, "b": 40}))
    assert result.text == "sum is 42 (zanzibar)" and not result.is_error


def test_a_tools_own_error_is_a_result_marked_as_an_error(client, tools_server):
    result = run(client.call_tool(tools_server, "fails", {"reason": "tests"}))
    assert result.is_error
    assert "refused on purpose: tests" in result.text


def test_a_server_that_exits_mid_call_is_one_line_naming_it(client, tools_server):
    with pytest.raises(McpError) as info:
        run(client.call_tool(tools_server, "dies", {}))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("test tools: the server exited")
    assert "dying on purpose" in message


def test_a_server_that_never_answers_times_out(client, tools_server):
    async def call():
        return await client.call_tool(tools_server, "hangs", {}, timeout_s=1.5)

    loop_time = []

    async def timed():
        start = asyncio.get_running_loop().time()
        try:
            await call()
        finally:
            loop_time.append(asyncio.get_running_loop().time() - start)

    with pytest.raises(McpError, match=r"test tools: no answer in 1.5 s"):
        run(timed())
    assert loop_time[0] < 15  # the timeout, plus stopping the process: not the hour it sleeps


def test_a_server_that_cannot_start_says_why(client, tmp_path):
    crash = stdio_server(write_crash_at_start(tmp_path), name="broken")
    with pytest.raises(McpError) as info:
        run(client.list_tools(crash))
    assert str(info.value).startswith("broken: the server exited")
    assert "missing configuration" in str(info.value)
    missing = stdio_server(tmp_path / "x.py", name="nowhere")
    missing.command = str(tmp_path / "no-such-program")
    with pytest.raises(McpError, match=r"nowhere: could not start"):
        run(client.list_tools(missing))


def test_the_gui_loop_is_not_blocked_while_a_call_hangs(client, tools_server):
    """The call runs on the client's own loop: the caller's loop keeps ticking meanwhile,
    and a second server's call completes while the first still hangs."""

    async def both():
        ticks = 0
        hang = asyncio.ensure_future(
            client.call_tool(tools_server, "hangs", {}, timeout_s=4))
        added = await client.call_tool(tools_server, "add", {"a": 1, "b": 1})
        while not hang.done():
            ticks += 1
            await asyncio.sleep(0.01)
        with pytest.raises(McpError):
            hang.result()
        return added, ticks

    added, ticks = run(both())
    assert added.text == "sum is 2 (zanzibar)"
    assert ticks > 50


def test_servers_are_kept_in_the_store_and_keys_in_the_keychain(app_env):
    store = Store(app_env)
    try:
        servers = McpServers(store)
        local = servers.add("Local", command=sys.executable, args=["-m", "x"])
        remote = servers.add("Remote", url="http://127.0.0.1:9/mcp", key="sk-secret-1")
        assert secrets.get_secret(remote.key_user) == "sk-secret-1"
        stored = store.get_value("mcp_servers")
        assert "sk-secret-1" not in repr(stored)
        again = McpServers(store)
        assert [s.name for s in again.servers()] == ["Local", "Remote"]
        assert again.get(local.id).args == ["-m", "x"]
        assert again.key(again.get(remote.id)) == "sk-secret-1"
        again.update(remote.id, "Remote", url="http://127.0.0.1:9/mcp")  # key kept
        assert again.key(again.get(remote.id)) == "sk-secret-1"
        again.remove(remote.id)
        assert secrets.get_secret(remote.key_user) is None
        with pytest.raises(ValueError, match="command"):
            again.add("Nothing")
        with pytest.raises(ValueError, match="http"):
            again.add("Bad", url="ftp://x")
    finally:
        store.close()


def test_tool_names_are_unique_in_a_chat():
    schema = {"type": "object", "properties": {}}
    tools = [McpTool("a", "files", "read", "", schema), McpTool("b", "web", "read", "", schema),
             McpTool("b", "web", "fetch.page", "", schema)]
    names = exposed_names(tools)
    assert set(names) == {"files_read", "web_read", "fetch_page"}
    assert names["fetch_page"].name == "fetch.page"


def tool_message(conversation_id: str) -> Message:
    call = {"id": "call_1", "name": "weather", "arguments": '{"city": "Reykjavik"}'}
    return Message("t1", conversation_id, None, "tool", "cold and windy",
                   meta={"tool_call": call, "server": "Weather", "state": "done"})


def test_search_finds_a_tool_calls_name_arguments_and_result(tmp_path):
    store = Store(tmp_path)
    try:
        conv = store.create_conversation("Trip")
        store.add_message(tool_message(conv.id))
        [by_argument] = store.search_hits("reykjavik")
        assert (by_argument.message_id, by_argument.role) == ("t1", TOOL_CALL_ROLE)
        assert MARK_START + "Reykjavik" in by_argument.snippet
        assert [h.role for h in store.search_hits("weather")] == [TOOL_CALL_ROLE]
        assert [(h.message_id, h.role) for h in store.search_hits("windy")] == [("t1", "tool")]
        assert store.search("reykjavik") == {conv.id}
        store.update_message("t1", meta={})  # no call any more: not found by it
        assert store.search_hits("reykjavik") == []
    finally:
        store.close()


def test_migration_indexes_tool_calls_made_before_their_index(tmp_path):
    store = Store(tmp_path)
    conv = store.create_conversation("Old")
    store.add_message(tool_message(conv.id))
    store.close()
    con = sqlite3.connect(tmp_path / DB_NAME)  # back to version 5: no tool-call index
    for name in ("tool_call_fts_ai", "tool_call_fts_ad", "tool_call_fts_au"):
        con.execute(f"DROP TRIGGER {name}")
    con.execute("DROP TABLE tool_call_fts")
    con.execute("PRAGMA user_version=5")
    con.commit()
    con.close()
    store = Store(tmp_path)
    try:
        assert [(h.message_id, h.role) for h in store.search_hits("reykjavik")] == [
            ("t1", TOOL_CALL_ROLE)]
    finally:
        store.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_streamable_http_server_lists_and_calls(client, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(write_http_server(tmp_path)), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "no HTTP server"
            time.sleep(0.1)
        server = McpServer(id="h", name="web", url=f"http://127.0.0.1:{port}/mcp")
        tools = run(client.list_tools(server, key="sk-test"))
        assert [t.name for t in tools] == ["add"]
        result = run(client.call_tool(server, "add", {"a": 3, "b": 4}, key="sk-test"))
        assert result.text == "sum is 7"
    finally:
        proc.terminate()
        proc.wait(10)
    with pytest.raises(McpError, match=r"^web: "):  # gone: one line naming the server
        run(client.list_tools(server))
