"""MCP tools in the app, through the real window on the real engine (issue #29 item 3).

An MCP server written here with the official SDK (``MCPServer``, formerly FastMCP) runs over
stdio with ``sys.executable``. It is added in Settings ▸ Tools (the real dialog, its fields
typed, Add clicked, its tools listed); a chat turns tools on in its Chat Settings with
"Call a tool first", which holds the default SmolLM2's first reply to a valid call (the
grammar path), so the call is deterministic. The pane asks; Allow once is clicked; the
result shows in the tool block, goes back to the model and the reply continues; the call and
its result are in the store (a fresh Store reads them), found by search, in the export.
Servers that answer with an error, crash mid-call or hang: each error is the call's result,
shown and sent to the model, the chat goes on, and another pane answers meanwhile.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QDialogButtonBox

from app.chat.message_model import TOGGLE_SCHEME
from app.core import exchange
from app.core.records import Status
from app.core.store import Store
from tests.app_helpers import WAIT_MS, greedy, open_window, wait_idle
from tests.mcp_servers import stdio_server, write_single_server
from tests.user_path import answer_modal, click_button, shortcut, type_and_send

pytestmark = pytest.mark.model


@pytest.fixture
def harness(qtbot, qasync_loop, app_env, app_engine):
    h = open_window(qtbot, app_env, app_engine)
    yield h
    h.close()


def turn_tools_on(qtbot, pane) -> None:
    """Chat Settings (the pane's button): Use tools + Call a tool first, OK."""

    def answer(dialog) -> None:
        dialog.form.tools_check.setChecked(True)
        dialog.form.tools_first.setChecked(True)
        click_button(qtbot, dialog, QDialogButtonBox.StandardButton.Ok)

    answer_modal(qtbot, lambda: qtbot.mouseClick(pane.settings_button,
                                                 Qt.MouseButton.LeftButton), answer)
    assert pane.session.settings.tools and pane.session.settings.tool_choice == "required"


def wait_for_question(qtbot, pane) -> None:
    """Until the pane asks about a call (fails at once, saying what happened, when the
    reply ended without one)."""
    qtbot.waitUntil(lambda: pane.tool_bar.isVisible() or not pane.session.busy,
                    timeout=WAIT_MS)
    assert pane.tool_bar.isVisible(), [(m.role, m.status, m.content, m.meta)
                                       for m in pane.session.active_path()]


def path_roles(pane) -> list[str]:
    return [m.role for m in pane.session.active_path()]


def tool_messages(pane) -> list:
    return [m for m in pane.session.active_path() if m.role == "tool"]


def test_a_chat_calls_an_mcp_tool_added_in_settings(harness, qtbot, tmp_path):
    w = harness.window
    script = write_single_server(tmp_path, "ok")
    listed: dict[str, str] = {}

    def add_server(dialog) -> None:
        page = dialog.tools_page
        dialog.tabs.setCurrentWidget(page)
        qtbot.keyClicks(page.name_edit, "Weather")
        qtbot.keyClicks(page.command_edit, sys.executable)
        qtbot.keyClicks(page.args_edit, str(script))
        qtbot.mouseClick(page.add_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: "1 tool(s)" in page.tools_label.text(), timeout=60_000)
        listed["tools"] = page.tools_label.text()
        listed["result"] = page.result_label.text()
        click_button(qtbot, dialog, QDialogButtonBox.StandardButton.Cancel)

    answer_modal(qtbot, lambda: shortcut(qtbot, w, w.act_settings), add_server)
    assert "weather: The weather in a city." in listed["tools"]
    assert "Weather lists 1 tool(s)" in listed["result"]
    [server] = w.tools.servers.servers()
    assert (server.command, server.args) == (sys.executable, [str(script)])

    pane = w.focused_pane
    pane.session.set_settings(greedy(64))
    turn_tools_on(qtbot, pane)
    type_and_send(qtbot, pane, "What is the weather in Lisbon?")
    wait_for_question(qtbot, pane)
    asked = pane.tool_label.text()
    assert asked.startswith("The model wants to call weather (server Weather) with {")
    call = tool_messages(pane)[0].meta["tool_call"]
    assert call["name"] == "weather" and isinstance(json.loads(call["arguments"])["city"], str)
    assert pane.session.busy  # waiting for the answer: nothing else is sent meanwhile
    asking = tool_messages(pane)[0]
    assert pane.model.waiting_text(asking) == "Waiting for your answer: call weather?"

    qtbot.mouseClick(pane.allow_once_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, pane)
    assert not pane.tool_bar.isVisible()
    assert path_roles(pane) == ["user", "assistant", "tool", "assistant"]
    caller, result, answer = pane.session.active_path()[1:]
    assert caller.meta["tool_calls"][0]["function"]["name"] == "weather"
    assert "<tool_call>" not in caller.content  # the call is kept apart from the text
    assert result.content == "sunny and 31 degrees, zanzibar weather"
    assert result.meta["state"] == "done" and not result.meta["is_error"]
    assert answer.status in (Status.COMPLETE, Status.LENGTH) and answer.content
    assert answer.parent_id == result.id

    # shown in the pane: a closed block with the tool, its arguments and the result's start;
    # a click on its link opens it
    row = pane.model.row_of(result.id)
    closed = pane.model.entry(row).doc.toPlainText()
    assert "▸ weather" in closed and "sunny and 31 degrees" in closed
    pane.view.scrollTo(pane.model.index(row))
    body = pane.view.row_geometry(row).body
    link = next(QPoint(x, body.top() + 6) for x in range(body.left(), body.right())
                if pane.view.anchor_at(QPoint(x, body.top() + 6))[1] == TOGGLE_SCHEME)
    qtbot.mouseClick(pane.view.viewport(), Qt.MouseButton.LeftButton, pos=link)
    opened = pane.model.entry(row).doc.toPlainText()
    assert "▾ weather" in opened and call["arguments"] in opened

    # the model got the result: the prompt of the reply after it holds it
    prompt = pane.session.prompt_messages(result.id)
    assert any("sunny and 31 degrees" in m["content"] for m in prompt)

    # searchable, exported, and saved: a fresh Store on the same folder reads it all back
    sid = pane.session.id
    assert sid in harness.store.search("zanzibar")
    hits = harness.store.search_hits("zanzibar")
    assert any(h.message_id == result.id and h.role == "tool" for h in hits)
    chat = exchange.load_chat(harness.store, sid)
    markdown = exchange.to_markdown(chat)
    assert "**Tool call** `weather`" in markdown and "sunny and 31 degrees" in markdown
    [back] = exchange.parse_json(exchange.to_json_text([chat]))  # the import reads it back
    imported = {m.id: m for m in back.messages}
    assert imported[result.id].role == "tool"
    assert imported[result.id].meta["tool_call"] == call
    again = Store(harness.store.data_dir)
    try:
        saved = {m.id: m for m in again.load_messages(sid)}
        assert saved[result.id].role == "tool"
        assert saved[result.id].content == result.content
        assert saved[result.id].meta["tool_call"] == call
        assert saved[caller.id].meta["tool_calls"] == caller.meta["tool_calls"]
    finally:
        again.close()


def test_failing_servers_show_their_errors_and_the_chat_goes_on(harness, qtbot, tmp_path):
    w = harness.window
    hub = w.tools
    other = w.focused_pane
    pane = w.new_chat(new_pane=True)
    pane.session.set_settings(dataclasses.replace(greedy(64), tools=True,
                                                  tool_choice="required"))
    other.session.set_settings(greedy(8))
    expected = {
        "error": "Error executing tool weather: the weather service is down",
        "crash": "the server exited (it said: weather server crashed)",
        "hang": "no answer in 20 s",
    }
    for behaviour, text in expected.items():
        # the hang's limit leaves the other chat time to answer while the call hangs
        hub.set_timeout(20 if behaviour == "hang" else 3)
        for s in hub.servers.servers():
            hub.servers.set_enabled(s.id, False)
        server = stdio_server(write_single_server(tmp_path, behaviour), name=behaviour)
        hub.servers.add(server.name, command=server.command, args=server.args)
        type_and_send(qtbot, pane, f"Weather in Oslo? ({behaviour})")
        wait_for_question(qtbot, pane)
        qtbot.mouseClick(pane.allow_once_button, Qt.MouseButton.LeftButton)
        if behaviour == "hang":  # meanwhile another chat answers: nothing else stalls
            type_and_send(qtbot, other, "Say hi.")
            wait_idle(qtbot, other)
            assert other.session.active_path()[-1].status in (Status.COMPLETE, Status.LENGTH)
            assert pane.session.busy, "the hung call ended before the other chat answered"
        wait_idle(qtbot, pane)
        path = pane.session.active_path()
        assert [m.role for m in path[-3:]] == ["assistant", "tool", "assistant"]
        result, answer = path[-2:]
        assert result.meta["is_error"] and result.meta["state"] == "error"
        assert text in result.content and result.content.startswith("Error")
        assert "\n" not in result.content
        shown = pane.model.entry(pane.model.row_of(result.id)).doc.toPlainText()
        assert text in shown
        assert answer.status in (Status.COMPLETE, Status.LENGTH)
        assert any(text in m["content"] for m in pane.session.prompt_messages(result.id))


def test_deny_and_always_allow(harness, qtbot, tmp_path):
    w = harness.window
    hub = w.tools
    server = stdio_server(write_single_server(tmp_path, "ok"), name="Weather")
    added = hub.servers.add(server.name, command=server.command, args=server.args)
    pane = w.focused_pane
    pane.session.set_settings(dataclasses.replace(greedy(64), tools=True,
                                                  tool_choice="required"))
    type_and_send(qtbot, pane, "Weather in Rome?")
    wait_for_question(qtbot, pane)
    qtbot.mouseClick(pane.deny_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, pane)
    denied = tool_messages(pane)[-1]
    assert denied.content == "The user denied this tool call."
    assert denied.meta["state"] == "denied"
    assert path_roles(pane)[-1] == "assistant"

    type_and_send(qtbot, pane, "And in Paris?")
    wait_for_question(qtbot, pane)
    qtbot.mouseClick(pane.allow_always_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, pane)
    assert tool_messages(pane)[-1].content.startswith("sunny")
    assert hub.servers.get(added.id).always_allowed == ["weather"]

    asked = []
    pane.session.toolAsk.connect(lambda mid: asked.append(mid) if mid else None)
    type_and_send(qtbot, pane, "And in Madrid?")
    wait_idle(qtbot, pane)
    assert not asked, "an always-allowed tool was asked about"
    assert tool_messages(pane)[-1].content.startswith("sunny")
    assert len(tool_messages(pane)) == 3
