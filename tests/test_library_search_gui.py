"""Search on the user's path: Ctrl+F, type, the ranked hits with snippets stand in for the
chat list, Enter opens the best hit's chat scrolled to its message (on its branch), a search
with nothing found says so, Esc clears."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QApplication

from app.core.records import Message, new_id
from app.core.store import Store
from app.library.search_results import HitRole
from tests.app_helpers import engineless_window


def type_text(widget, text: str) -> None:
    """Type any characters (QTest's keyClicks takes ASCII only): one key event per character
    carrying its text, as a keyboard layout or input method delivers them."""
    for ch in text:
        for kind in (QEvent.Type.KeyPress, QEvent.Type.KeyRelease):
            QApplication.sendEvent(
                widget, QKeyEvent(kind, Qt.Key.Key_unknown, Qt.KeyboardModifier.NoModifier, ch)
            )


LONG = "A paragraph of ordinary text that fills the row. " * 6


def long_chat(store: Store) -> tuple[str, str]:
    """40 messages, the 5th holding the word searched for; but the branch shown is a newer
    alternative of that 5th message (edited later), so the hit is on a hidden branch.
    Returns (chat id, the hit's message id)."""
    conv = store.create_conversation("Field notes")
    parent, target, fork = None, "", None
    for i in range(40):
        role = ("user", "assistant")[i % 2]
        text = "The quokka is a small wallaby; quokka quokka." if i == 4 else f"{i}: {LONG}"
        m = Message(new_id(), conv.id, parent, role, text, created=1000.0 + i)
        store.add_message(m)
        if parent is not None:
            store.set_active_child(parent, m.id)
        if i == 4:
            target, fork = m.id, parent
        parent = m.id
    alt = Message(new_id(), conv.id, fork, "assistant", "a newer alternative", created=2000.0)
    store.add_message(alt)
    store.set_active_child(fork, alt.id)
    store.set_active_leaf(conv.id, alt.id)
    return conv.id, target


@pytest.fixture
def window(qtbot, qasync_loop, app_env):
    store = Store(app_env)
    ids = long_chat(store)
    other = store.create_conversation("Zoo trip")
    m = Message(new_id(), other.id, None, "user", f"{LONG} we may see a quokka {LONG}")
    store.add_message(m)
    store.set_active_leaf(other.id, m.id)
    with engineless_window(qtbot, store, size=(1200, 700)) as w:
        yield w, ids, other.id


def test_enter_opens_the_best_hit_scrolled_to_its_message(window, qtbot):
    w, (chat_id, target), other_id = window
    sidebar = w.sidebar
    w.new_chat()  # the focused pane shows something else
    qtbot.keyClick(w, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)  # Find
    assert sidebar.search.hasFocus()
    qtbot.keyClicks(sidebar.search, "quok")
    qtbot.waitUntil(lambda: sidebar.results.isVisible())
    assert not sidebar.view.isVisible()
    hits = [sidebar.results.model().index(r).data(HitRole)
            for r in range(sidebar.results.model().rowCount())]
    # three mentions in a short message rank above one in a long one
    assert [(h.conversation_id, h.message_id) for h in hits][:1] == [(chat_id, target)]
    assert {h.conversation_id for h in hits} == {chat_id, other_id}
    assert "quokka" in sidebar.results.model().index(0).data(Qt.ItemDataRole.DisplayRole)

    qtbot.keyClick(sidebar.search, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: w.focused_pane.session.id == chat_id)
    pane = w.focused_pane
    # the hidden alternative is now the branch shown, and the view sits at it
    assert len(pane.session.active_path()) == 40
    assert target in [m.id for m in pane.session.active_path()]
    row = pane.model.row_of(target)
    assert row == 4
    qtbot.waitUntil(lambda: pane.view.currentIndex().row() == row)
    view = pane.view

    def at_target() -> bool:
        rect = view.visualRect(pane.model.index(row))
        return view.viewport().rect().intersects(rect) and rect.top() <= 8

    qtbot.waitUntil(at_target)
    bar = view.verticalScrollBar()
    assert bar.maximum() > 0 and bar.value() < bar.maximum()  # not left at the bottom


def test_down_then_enter_opens_another_hit(window, qtbot):
    w, _, other_id = window
    sidebar = w.sidebar
    w.focus_search()
    qtbot.keyClicks(sidebar.search, "quokka")
    qtbot.waitUntil(lambda: sidebar.results.isVisible())
    qtbot.keyClick(sidebar.search, Qt.Key.Key_Down)
    assert sidebar.results.hasFocus()
    rows = sidebar.results.model().rowCount()
    for _ in range(rows):
        qtbot.keyClick(sidebar.results, Qt.Key.Key_Down)
    assert sidebar.results.currentIndex().data(HitRole).conversation_id == other_id
    qtbot.keyClick(sidebar.results, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: w.focused_pane.session.id == other_id)
    qtbot.keyClick(sidebar.results, Qt.Key.Key_Escape)  # Esc in the results clears too
    assert sidebar.search.text() == "" and sidebar.search.hasFocus()
    assert sidebar.view.isVisible() and not sidebar.results.isVisible()


def test_no_results_says_so_and_esc_clears(window, qtbot):
    w, _, _ = window
    sidebar = w.sidebar
    w.focus_search()
    type_text(sidebar.search, "платипус")
    qtbot.waitUntil(lambda: sidebar.empty.isVisible())
    assert "платипус" in sidebar.empty.text()
    assert not sidebar.results.isVisible() and not sidebar.view.isVisible()
    before = w.focused_pane.session.id
    qtbot.keyClick(sidebar.search, Qt.Key.Key_Return)  # nothing to open: nothing happens
    assert w.focused_pane.session.id == before
    qtbot.keyClick(sidebar.search, Qt.Key.Key_Escape)
    assert sidebar.search.text() == ""
    assert sidebar.view.isVisible() and not sidebar.empty.isVisible()
