"""What a user does, for the app tests: type and press keys, click a row's buttons, choose from
the real context menu, answer the real modal dialog. Only public widgets are touched, so the
tests follow the user's path through whatever code sits behind it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QContextMenuEvent
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QDialogButtonBox, QLineEdit, QWidget

from tests.app_helpers import WAIT_MS


def type_and_send(qtbot: Any, pane: Any, text: str) -> None:
    """Type into the pane's input and press Return."""
    pane.input.setFocus()
    qtbot.keyClicks(pane.input, text)
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)


def click_action(qtbot: Any, pane: Any, message_id: str, name: str) -> None:
    """Click one of a message row's buttons (copy, edit, regenerate, branch, prev, next)."""
    row = pane.model.row_of(message_id)
    assert row >= 0, f"{message_id} is not shown"
    rect = pane.view.row_geometry(row).actions[name]
    qtbot.mouseClick(pane.view.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())


def choose_from_context_menu(pane: Any, message_id: str, *path: str) -> None:
    """Right-click a message and choose ``path`` (submenu, ..., item) in the real menu."""
    row = pane.model.row_of(message_id)
    pos = pane.view.row_geometry(row).body.center()
    chosen: list[bool] = []

    def pick() -> None:
        menu = top = QApplication.activePopupWidget()
        action = None
        for label in path:
            action = next(a for a in menu.actions() if a.text().replace("&", "") == label)
            chosen.append(action.isEnabled())
            if action.menu() is not None:
                menu = action.menu()
        top.close()
        action.trigger()

    QTimer.singleShot(0, pick)
    viewport = pane.view.viewport()
    QApplication.sendEvent(viewport, QContextMenuEvent(
        QContextMenuEvent.Reason.Mouse, pos, viewport.mapToGlobal(pos)))
    assert chosen == [True] * len(path), f"menu path {path} not available: {chosen}"


def alt_key(qtbot: Any, pane: Any, message_id: str, key: Qt.Key) -> None:
    """Alt+Left / Alt+Right on a message row (the keyboard's alternative switcher)."""
    pane.view.setCurrentIndex(pane.model.index(pane.model.row_of(message_id)))
    pane.view.setFocus()
    qtbot.keyClick(pane.view, key, Qt.KeyboardModifier.AltModifier)


def shortcut(qtbot: Any, window: QWidget, action: Any) -> None:
    """Press an action's keyboard shortcut on the window."""
    seq = action.shortcut()
    assert not seq.isEmpty(), f"{action.text()} has no shortcut"
    activate(qtbot, window)
    QTest.keySequence(window, seq)


def activate(qtbot: Any, window: QWidget) -> None:
    """Make ``window`` the active window (shortcuts only reach the active one)."""
    window.activateWindow()
    window.raise_()
    qtbot.waitUntil(window.isActiveWindow, timeout=5000)


def answer_modal(qtbot: Any, open_it: Callable[[], object], answer: Callable[[QWidget], None],
                 kind: type | None = None) -> list[QWidget]:
    """Run ``open_it`` (which opens a modal dialog and waits in it) while ``answer`` handles
    the dialog as a user would; returns the dialogs answered. Fails if none opened."""
    seen: list[QWidget] = []
    poll = QTimer()
    poll.setInterval(10)

    def check() -> None:
        w = QApplication.activeModalWidget()
        if w is None or w in seen or (kind is not None and not isinstance(w, kind)):
            return
        seen.append(w)
        answer(w)

    poll.timeout.connect(check)
    poll.start()
    try:
        open_it()
    finally:
        poll.stop()
    assert seen, "no dialog opened"
    return seen


def click_button(qtbot: Any, dialog: QWidget, which: QDialogButtonBox.StandardButton) -> None:
    """Click a standard button (OK, Cancel, Delete ...) of a dialog's button box."""
    for box in dialog.findChildren(QDialogButtonBox):
        button = box.button(which)
        if button is not None:
            qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
            return
    raise AssertionError(f"{dialog.windowTitle()!r} has no {which} button")


__all__ = ["WAIT_MS", "alt_key", "answer_modal", "choose_from_context_menu", "click_action",
           "click_button", "shortcut", "type_and_send"]


def search_by_typing(qtbot: Any, window: Any, text: str) -> None:
    """Find Chats (its shortcut), replace the search text by typing, wait for the filter."""
    sidebar = window.sidebar
    shortcut(qtbot, window, window.act_find)
    assert sidebar.search.hasFocus()
    qtbot.keyClick(sidebar.search, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)
    if text:
        qtbot.keyClicks(sidebar.search, text)
    else:
        qtbot.keyClick(sidebar.search, Qt.Key.Key_Delete)
    qtbot.waitUntil(lambda: sidebar.proxy.query == text.strip(), timeout=5000)


def rename_by_keys(qtbot: Any, window: Any, title: str) -> None:
    """Rename the focused chat: F2 opens the sidebar's editor; type the title, press Return."""
    shortcut(qtbot, window, window.act_rename)
    editors = window.sidebar.view.viewport().findChildren(QLineEdit)
    assert len(editors) == 1, "no rename editor opened"
    editor = editors[0]
    qtbot.keyClick(editor, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)
    qtbot.keyClicks(editor, title)
    qtbot.keyClick(editor, Qt.Key.Key_Return)
    # the delegate commits and closes its editor through a queued call
    view = window.sidebar.view
    qtbot.waitUntil(lambda: view.state() != view.State.EditingState, timeout=5000)


def answer_message_box(qtbot: Any, open_it: Callable[[], object], button_text: str) -> str:
    """Run ``open_it``, which shows a QMessageBox; click its button labelled ``button_text``
    (found by text, whatever role or standard button it has). Returns the box's text."""
    from PySide6.QtWidgets import QMessageBox

    texts: list[str] = []

    def click(box: QWidget) -> None:
        texts.append(box.text())
        for b in box.buttons():
            if b.text().replace("&", "") == button_text:
                qtbot.mouseClick(b, Qt.MouseButton.LeftButton)
                return
        box.reject()
        raise AssertionError(f"no {button_text!r} button in {[b.text() for b in box.buttons()]}")

    answer_modal(qtbot, open_it, click, QMessageBox)
    return texts[0]


def delete_from_sidebar(qtbot: Any, window: Any, conversation_id: str, button_text: str) -> str:
    """Select a chat in the sidebar, press Delete, answer the confirmation box."""
    sidebar = window.sidebar
    sidebar.select(conversation_id)
    sidebar.view.setFocus()
    return answer_message_box(
        qtbot, lambda: qtbot.keyClick(sidebar.view, Qt.Key.Key_Delete), button_text)
