"""Input that cannot hurt the user (issue 25, item 3), on the real engine and default model.

A double click on Send, Send to All with a draft typed, Esc from the message list, the draft's
token count under the box with an over-long draft flagged before sending, and a chat that goes
on after the model refused an over-long message. Every step is the user's: real clicks (a
double click through the window system's detection), real keys, the real clipboard.
"""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtTest import QTest

from app.core.records import Status
from tests.app_helpers import WAIT_MS, greedy, last_reply, open_window, wait_idle
from tests.reference import chat_prompt
from tests.user_path import type_and_send

pytestmark = pytest.mark.model

LONG_PROMPT = "Write a long story about a dragon who learns to read."
HUGE = "hello " * 9000  # about 9,000 tokens: over SmolLM2's 8,192


@pytest.fixture
def harness(qtbot, qasync_loop, app_env, app_engine):
    h = open_window(qtbot, app_env, app_engine)
    yield h
    h.close()


def double_click(widget) -> None:
    """A double click as the window system delivers it (QGuiApplication detects it)."""
    window = widget.window()
    pos: QPoint = widget.mapTo(window, widget.rect().center())
    QTest.mouseDClick(window.windowHandle(), Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier, pos)


def test_a_double_click_on_send_keeps_the_reply_it_started(harness, qtbot):
    pane = harness.window.focused_pane
    pane.session.set_settings(greedy(24))
    qtbot.keyClicks(pane.input, "Say hello.")
    double_click(pane.send_button)
    assert pane.session.busy  # the first click sent
    wait_idle(qtbot, pane)
    user, reply = pane.session.active_path()
    assert user.content == "Say hello." and reply.content
    assert reply.status in (Status.COMPLETE, Status.LENGTH), reply.status  # not Stopped
    # a deliberate click on Stop still stops
    pane.session.set_settings(greedy(400))
    type_and_send(qtbot, pane, LONG_PROMPT)
    qtbot.waitUntil(lambda: bool(last_reply(pane).content), timeout=WAIT_MS)
    qtbot.mouseClick(pane.send_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, pane)
    assert last_reply(pane).status == Status.STOPPED


def test_send_to_all_sends_the_draft_typed_in_the_focused_pane(harness, qtbot):
    w = harness.window
    first = w.focused_pane
    first.session.set_settings(greedy(6))
    second = w.new_chat(new_pane=True)
    second.session.set_settings(greedy(6))
    qtbot.keyClicks(second.input, "Say yes.")
    shortcut = Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier
    qtbot.keyClick(second.input, Qt.Key.Key_Return, shortcut)  # Chat > Send to All
    assert first.session.busy and second.session.busy
    assert second.input.toPlainText() == ""  # the draft went out, not left behind
    assert not w.compare_bar.isVisible() and not w.act_send_all.isChecked()
    wait_idle(qtbot, first, second)
    assert [p.session.active_path()[0].content for p in (first, second)] == ["Say yes."] * 2
    # with nothing typed it opens the bar; Esc in the bar closes it, focus back in the pane
    qtbot.keyClick(second.input, Qt.Key.Key_Return, shortcut)
    assert w.compare_bar.isVisible() and w.compare_bar.input.hasFocus()
    qtbot.keyClick(w.compare_bar.input, Qt.Key.Key_Escape)
    assert not w.compare_bar.isVisible() and not w.act_send_all.isChecked()
    assert w.focused_pane.input.hasFocus()


def test_esc_in_the_message_list_stops_the_reply(harness, qtbot):
    pane = harness.window.focused_pane
    pane.session.set_settings(greedy(400))
    type_and_send(qtbot, pane, LONG_PROMPT)
    qtbot.waitUntil(lambda: pane.model.rowCount() == 2 and bool(last_reply(pane).content),
                    timeout=WAIT_MS)
    rect = pane.view.visualRect(pane.model.index(0, 0))
    qtbot.mouseClick(pane.view.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    assert pane.view.hasFocus()
    qtbot.keyClick(pane.view, Qt.Key.Key_Escape)
    wait_idle(qtbot, pane)
    assert last_reply(pane).status == Status.STOPPED


def test_the_draft_shows_its_tokens_and_an_over_long_one_is_flagged_before_sending(
    harness, qtbot
):
    pane = harness.window.focused_pane
    meter = pane.draft_meter
    qtbot.keyClicks(pane.input, "Hello there")
    qtbot.waitUntil(lambda: meter.counted == "Hello there", timeout=WAIT_MS)
    expected = len(chat_prompt([{"role": "user", "content": "Hello there"}]))
    assert meter.isVisible() and meter.prompt_tokens == expected
    assert meter.text() == f"{expected:,} tokens · {expected:,} of 8,192 in context"
    assert not meter.over
    # pasted: far more than the model's context
    QGuiApplication.clipboard().setText(HUGE)
    qtbot.keyClick(pane.input, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)
    qtbot.keyClick(pane.input, Qt.Key.Key_V, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: meter.counted == HUGE, timeout=WAIT_MS)
    assert meter.over and meter.text().startswith("Too long:")
    assert meter.prompt_tokens == len(chat_prompt([{"role": "user", "content": HUGE}]))
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)
    assert len(pane.session.tree) == 0 and not pane.session.busy  # kept, not sent
    assert pane.notice_label.isVisible() and "longer than" in pane.notice_label.text()
    assert pane.input.toPlainText() == HUGE


def test_after_a_refused_over_long_message_the_chat_goes_on(harness, qtbot):
    pane = harness.window.focused_pane
    pane.session.set_settings(greedy(8))
    type_and_send(qtbot, pane, "Hi!")
    wait_idle(qtbot, pane)
    first_user, first_reply = pane.session.active_path()
    # sent at once, before the meter's count came back: the engine refuses it
    pane.input.setPlainText(HUGE)
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)
    wait_idle(qtbot, pane)
    refused = last_reply(pane)
    assert refused.status == Status.ERROR and "context limit" in refused.meta["error"]
    # the next message is answered, from before the refused one (kept as a branch)
    type_and_send(qtbot, pane, "Thanks!")
    wait_idle(qtbot, pane)
    path = pane.session.active_path()
    assert [m.content for m in path[:3]] == ["Hi!", first_reply.content, "Thanks!"]
    assert path[3].status in (Status.COMPLETE, Status.LENGTH) and path[3].content
    assert pane.session.tree.get(refused.parent_id).content == HUGE
