"""First-hour defects of the desktop app (issue 11), each through the real widgets.

These need no model: the window runs on a bridge without an engine. The ones that need the
real model are in test_app_defects_live.py.
"""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QContextMenuEvent
from PySide6.QtWidgets import QApplication, QMessageBox

from app.engine_bridge import EngineBridge
from app.main_window import MainWindow
from app.store import Store
from tests.gui_helpers import click_button, trigger_menu_item, when_modal, when_popup_menu


@pytest.fixture
def window(qtbot, qasync_loop, app_env):
    store = Store(app_env)
    bridge = EngineBridge()
    w = MainWindow(store, bridge)
    qtbot.addWidget(w)
    w.show()
    qtbot.waitExposed(w)
    yield w
    w.shutdown_chats()
    store.close()


def _chat_with_message(window, text="hello there", new_pane=False):
    pane = window.new_chat(new_pane=new_pane) if new_pane else window.focused_pane
    pane.send(text)  # no engine: the message is kept, the reply shows an error
    return pane.session


# ---- 1. deleting a chat goes through a real confirmation dialog ------------------------------


def test_delete_from_the_edit_menu_asks_then_deletes(window, qtbot):
    keep = _chat_with_message(window, "keep me")
    doomed = _chat_with_message(window, "delete me", new_pane=True)
    window.focus_pane(1)
    # Cancel first: nothing happens
    seen = when_modal(lambda box: click_button(box, "Cancel"), QMessageBox)
    window.act_delete.trigger()
    assert seen and "delete me" in seen[0].text()
    assert window.store.get_conversation(doomed.id) is not None
    # then the dialog's Delete button
    seen = when_modal(lambda box: click_button(box, "Delete"), QMessageBox)
    window.act_delete.trigger()
    assert seen
    assert window.store.get_conversation(doomed.id) is None
    assert window.store.load_messages(doomed.id) == []
    assert window.pane_for(doomed.id) is None and len(window.panes) == 1
    assert window.panes[0].session is keep


def test_delete_from_the_sidebar_context_menu(window, qtbot):
    a = _chat_with_message(window, "first chat")
    b = _chat_with_message(window, "second chat", new_pane=True)
    sidebar = window.sidebar
    sidebar.reload()
    row = sidebar.proxy.mapFromSource(sidebar.model.index(sidebar.model.row_of(a.id)))
    pos = sidebar.view.visualRect(row).center()
    when_popup_menu(lambda m: trigger_menu_item(m, "Delete…"))
    dialogs = when_modal(lambda box: click_button(box, "Delete"), QMessageBox)
    event = QContextMenuEvent(
        QContextMenuEvent.Reason.Mouse, pos, sidebar.view.viewport().mapToGlobal(pos)
    )
    QApplication.sendEvent(sidebar.view.viewport(), event)
    qtbot.waitUntil(lambda: bool(dialogs))
    qtbot.waitUntil(lambda: window.store.get_conversation(a.id) is None)
    assert window.pane_for(a.id) is None
    assert [p.session for p in window.panes] == [b]
    assert sidebar.visible_ids() == [b.id]


def test_delete_key_in_the_sidebar_on_the_last_pane_shows_another_chat(window, qtbot):
    a = _chat_with_message(window, "only pane chat")
    window.sidebar.reload()
    window.sidebar.select(a.id)
    window.sidebar.view.setFocus()
    when_modal(lambda box: click_button(box, "Delete"), QMessageBox)
    qtbot.keyClick(window.sidebar.view, Qt.Key.Key_Delete)
    assert window.store.get_conversation(a.id) is None
    assert len(window.panes) == 1 and window.panes[0].session.id != a.id
    assert window.panes[0].session.id in {c.id for c in window.store.list_conversations()} or (
        not window.panes[0].session.tree.by_id
    )
