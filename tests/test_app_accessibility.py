"""Issue 25 item 7: what a screen reader (VoiceOver, Orca) gets from the real main window,
read through Qt's accessibility API, the same interfaces the platform bridges walk; every
icon button's tooltip; Help ▸ Keyboard Shortcuts, generated from the window's actions."""

from __future__ import annotations

import pytest
from PySide6.QtGui import QAccessible, QKeySequence
from PySide6.QtWidgets import QAbstractButton, QApplication

from app.core.store import Store
from app.monitor.counters import PoolCounters
from app.monitor.monitor import CONTENT
from tests.app_helpers import engineless_window
from tests.gui_helpers import when_modal
from tests.ui_checks import accessible_nodes, unnamed_interactive
from tests.user_path import activate, shortcut, type_and_send

R = QAccessible.Role


@pytest.fixture
def window(qtbot, qasync_loop, app_env):
    with engineless_window(qtbot, Store(app_env), size=(1500, 900)) as w:
        yield w


def _counters(**kw) -> PoolCounters:
    base = dict(num_blocks=182, block_size=16, bytes_per_block=737_280, used=12, cached=3,
                free=167, shared=2, waste_fraction=0.05, saved_bytes=1_474_560, hit_rate=0.5,
                hits=1, queries=2, batch=2, step_ms=41.0, tokens_per_s=23.4, preemptions=0)
    return PoolCounters(**{**base, **kw})


def test_every_interactive_node_of_the_window_has_a_name_and_role(window, qtbot):
    type_and_send(qtbot, window.panes[0], "What is a KV cache?")  # a message row
    window.new_chat(new_pane=True)
    shortcut(qtbot, window, window.act_send_all)  # the compare bar
    panel = window.monitor_dock.widget()  # the monitor's counters page, as a snapshot shows it
    panel.pages.setCurrentIndex(CONTENT)
    panel.counters.set_counters(_counters())
    QApplication.processEvents()
    nodes = accessible_nodes(window)
    unnamed = unnamed_interactive(window)
    assert not unnamed, unnamed
    named = {obj: (role, name) for role, name, _cls, obj in nodes if obj is not None}
    # the panes, by number and chat; the send button; the monitor's counters with values
    for i, pane in enumerate(window.panes, 1):
        assert named[pane][1].startswith(f"Pane {i}: "), named[pane]
        assert named[pane.send_button] == (R.Button, "Send message")
    messages = [name for role, name, cls, _ in nodes if role == R.ListItem and cls == "item"]
    assert "You: What is a KV cache?" in messages, messages
    used = panel.counters.values["used"]
    assert named[used][1] == f"Used: {used.text()}" and used.text() != "–"


def test_every_icon_button_has_a_tooltip(window, qtbot):
    shortcut(qtbot, window, window.act_send_all)
    panel = window.monitor_dock.widget()
    panel.pages.setCurrentIndex(CONTENT)
    QApplication.processEvents()
    bare = []
    for b in window.findChildren(QAbstractButton):
        text = b.text().replace("&", "").strip()
        iconic = not b.icon().isNull() or (len(text) <= 1 and b.isVisibleTo(window))
        if b.isVisibleTo(window) and iconic and not b.toolTip().strip():
            bare.append(f"{b.metaObject().className()} {b.objectName()} {text!r}")
    assert not bare, bare


def test_help_keyboard_shortcuts_lists_every_shortcut_of_the_window(window, qtbot):
    from app.window.shortcuts_dialog import ShortcutsDialog

    seen = {}

    def read(dialog):
        assert isinstance(dialog, ShortcutsDialog)
        seen["rows"] = dialog.rows()
        dialog.reject()

    when_modal(read, ShortcutsDialog)
    shortcut(qtbot, window, window.act_shortcuts)  # Help ▸ Keyboard Shortcuts
    qtbot.waitUntil(lambda: "rows" in seen)
    rows = seen["rows"]
    listed = {(cmd, keys) for _menu, cmd, keys in rows}
    # every action of the window with keys, by its own text and keys (not a copied list)
    for a in window.actions():
        for seq in a.shortcuts():
            keys = seq.toString(QKeySequence.SequenceFormat.NativeText)
            assert any(cmd == a.text().replace("&", "") and keys in k for cmd, k in listed), (
                a.text(), keys)
    assert any(cmd == "Send" and keys == "Enter" for cmd, keys in listed)
    # a key changed on the action shows in the list (it is read off the live actions)
    window.act_branch.setShortcut(QKeySequence("Ctrl+Alt+B"))
    seen.clear()
    when_modal(read, ShortcutsDialog)
    shortcut(qtbot, window, window.act_shortcuts)
    qtbot.waitUntil(lambda: "rows" in seen)
    assert ("Branch From Last Message",
            QKeySequence("Ctrl+Alt+B").toString(QKeySequence.SequenceFormat.NativeText)) in {
        (c, k) for _m, c, k in seen["rows"]}


def test_tab_goes_round_the_window_every_stop_named(window, qtbot):
    """Full keyboard use: Tab from the message box visits every control and comes back (a
    table that keeps Tab to itself is a trap), Shift+Tab goes back; each stop is named."""
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest

    type_and_send(qtbot, window.panes[0], "What is a KV cache?")
    window.new_chat(new_pane=True)
    panel = window.monitor_dock.widget()
    panel.pages.setCurrentIndex(CONTENT)  # the monitor as a snapshot shows it
    activate(qtbot, window)
    window.focused_pane.focus_input()
    qtbot.waitUntil(lambda: QApplication.focusWidget() is window.focused_pane.input)
    start, seen = QApplication.focusWidget(), []
    for _ in range(80):
        QTest.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
        now = QApplication.focusWidget()
        if now is start:
            break
        seen.append(now)
    else:
        pytest.fail(f"Tab never came back: {[x.objectName() or type(x).__name__ for x in seen]}")
    reached = {x.objectName() for x in seen}
    for must in ("sendButton", "modelSelector", "searchField", "conversationList"):
        assert must in reached, (must, sorted(reached))
    unnamed = [f"{type(x).__name__} {x.objectName()}" for x in seen
               if not (x.accessibleName() or (isinstance(x, QAbstractButton) and x.text()))]
    assert not unnamed, unnamed
    QTest.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab, Qt.KeyboardModifier.ShiftModifier)
    assert QApplication.focusWidget() is seen[-1]
