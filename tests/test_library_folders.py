"""Folders: the store's folder API, and the sidebar's folder list on the user's path (New
Folder, drag chats onto a folder, show a folder, delete it: its chats move to the top level,
a folder's settings for the chats made in it)."""

from __future__ import annotations

import sqlite3

import pytest
from PySide6.QtCore import QEvent, QPoint, QPointF, Qt, QTimer
from PySide6.QtGui import QContextMenuEvent, QDragEnterEvent, QDragMoveEvent, QDropEvent
from PySide6.QtWidgets import QApplication, QDialogButtonBox, QInputDialog, QLineEdit

from app.core.records import ChatSettings, Message, new_id
from app.core.store import DB_NAME, Store
from engine import SamplingParams
from tests.app_helpers import engineless_window
from tests.user_path import answer_message_box, answer_modal


def started_chat(store: Store, title: str) -> str:
    conv = store.create_conversation(title)
    m = Message(new_id(), conv.id, None, "user", f"hello from {title}")
    store.add_message(m)
    store.set_active_leaf(conv.id, m.id)
    return conv.id


def test_store_folders(tmp_path):
    store = Store(tmp_path)
    a, b = started_chat(store, "a"), started_chat(store, "b")
    work = store.create_folder("work")
    home = store.create_folder("Home", ChatSettings("Be kind.", SamplingParams(temperature=0.1)))
    assert [f.name for f in store.list_folders()] == ["Home", "work"]
    store.move_to_folder([a, b], work.id)
    store.rename_folder(work.id, "Work")
    store.close()
    store = Store(tmp_path)  # all of it is on disk
    assert {c.id: c.folder_id for c in store.list_conversations()} == {a: work.id, b: work.id}
    again = store.get_folder(home.id)
    assert again.settings.system_prompt == "Be kind." and again.settings.sampling.temperature == 0.1
    assert store.get_folder(work.id).name == "Work"
    store.delete_folder(work.id)
    assert {c.id: c.folder_id for c in store.list_conversations()} == {a: None, b: None}
    assert [m.content for m in store.load_messages(a)] == ["hello from a"]  # nothing lost
    # the schema itself keeps chats when a folder row goes (ON DELETE SET NULL)
    store.move_to_folder([a], home.id)
    store._write("DELETE FROM folders WHERE id=?", (home.id,))
    assert store.get_conversation(a).folder_id is None
    store.close()


@pytest.fixture
def window(qtbot, qasync_loop, app_env):
    store = Store(app_env)
    ids = [started_chat(store, t) for t in ("alpha", "beta", "gamma")]
    with engineless_window(qtbot, store, size=(1200, 800)) as w:
        yield w, ids


def make_folder_by_button(qtbot, window, name: str) -> None:
    panel = window.sidebar.folders

    def answer(dialog) -> None:
        assert isinstance(dialog, QInputDialog)
        edit = dialog.findChild(QLineEdit)
        qtbot.keyClicks(edit, name)
        box = dialog.findChild(QDialogButtonBox)
        qtbot.mouseClick(box.button(QDialogButtonBox.StandardButton.Ok), Qt.MouseButton.LeftButton)

    answer_modal(qtbot, lambda: qtbot.mouseClick(panel.new_button, Qt.MouseButton.LeftButton),
                 answer)


def folder_row_center(window, name: str) -> QPoint:
    view = window.sidebar.folders.view
    model = view.model()
    row = next(r for r in range(model.rowCount())
               if str(model.index(r).data(Qt.ItemDataRole.EditRole) or "All Chats") == name)
    return view.visualRect(model.index(row)).center()


def drag_chats_to_folder(window, chat_ids: list[str], folder: str) -> bool:
    """Select the chats in the list, take the mime data the list's drag would carry, and
    deliver enter / move / drop events at the folder's row, as a drag does. True if the
    folder list accepted the drop."""
    sidebar = window.sidebar
    view = sidebar.view
    selection = view.selectionModel()
    selection.clear()
    indexes = [sidebar.proxy.mapFromSource(sidebar.model.index(sidebar.model.row_of(c)))
               for c in chat_ids]
    for i in indexes:
        selection.select(i, selection.SelectionFlag.Select)
    mime = view.model().mimeData(view.selectedIndexes())
    target = sidebar.folders.view.viewport()
    pos = QPointF(folder_row_center(window, folder))
    actions = Qt.DropAction.MoveAction | Qt.DropAction.CopyAction
    buttons, mods = Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    enter = QDragEnterEvent(pos, actions, mime, buttons, mods)
    QApplication.sendEvent(target, enter)
    move = QDragMoveEvent(pos, actions, mime, buttons, mods)
    QApplication.sendEvent(target, move)
    if not move.isAccepted():
        return False
    drop = QDropEvent(pos, actions, mime, buttons, mods, QEvent.Type.Drop)
    QApplication.sendEvent(target, drop)
    return drop.isAccepted()


def test_new_folder_drag_chats_in_show_it_and_drag_back(window, qtbot):
    w, (alpha, beta, gamma) = window
    make_folder_by_button(qtbot, w, "Projects")
    [folder] = w.store.list_folders()
    assert folder.name == "Projects"
    assert drag_chats_to_folder(w, [alpha, gamma], "Projects")
    assert {c.id: c.folder_id for c in w.store.list_conversations()} == {
        alpha: folder.id, beta: None, gamma: folder.id}
    view = w.sidebar.folders.view
    row_rect = view.visualRect(view.model().index(1))
    assert view.model().index(1).data(Qt.ItemDataRole.DisplayRole) == "Projects  (2)"
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=row_rect.center())
    assert set(w.sidebar.visible_ids()) == {alpha, gamma}  # the folder shown
    # a drop that is not chats is refused
    assert drag_chats_to_folder(w, [], "Projects") is False
    # back to the top level: dropped on "All Chats"
    assert drag_chats_to_folder(w, [alpha], "All Chats")
    assert w.store.get_conversation(alpha).folder_id is None
    assert set(w.sidebar.visible_ids()) == {gamma}


def choose_in_folder_menu(window, folder: str, item: str) -> None:
    view = window.sidebar.folders.view
    pos = folder_row_center(window, folder)

    def pick() -> None:
        menu = QApplication.activePopupWidget()
        action = next(a for a in menu.actions() if a.text().replace("&", "") == item)
        menu.close()
        action.trigger()

    QTimer.singleShot(0, pick)
    vp = view.viewport()
    QApplication.sendEvent(vp, QContextMenuEvent(QContextMenuEvent.Reason.Mouse, pos,
                                                 vp.mapToGlobal(pos)))


def test_deleting_a_folder_moves_its_chats_to_the_top_level(window, qtbot):
    w, (alpha, beta, _gamma) = window
    folder = w.store.create_folder("Old")
    w.sidebar.folders.move_chats([alpha, beta], folder.id)
    text = answer_message_box(qtbot, lambda: choose_in_folder_menu(w, "Old", "Delete Folder…"),
                              "Cancel")
    assert "Its 2 chats move to the top level" in text
    assert w.store.get_folder(folder.id) is not None
    answer_message_box(qtbot, lambda: choose_in_folder_menu(w, "Old", "Delete Folder…"),
                       "Delete")
    assert w.store.list_folders() == []
    assert {c.id: c.folder_id for c in w.store.list_conversations()}[alpha] is None
    assert len(w.store.list_conversations()) == 3  # no chat lost
    assert w.sidebar.folders.view.model().rowCount() == 1  # only "All Chats"


def test_new_chats_in_a_folder_start_with_its_settings(window, qtbot):
    w, _ = window
    settings = ChatSettings("Answer as a pirate.", SamplingParams(temperature=0.25, top_k=5))
    folder = w.store.create_folder("Pirates", settings)
    w.sidebar.folders.reload()
    choose_in_folder_menu(w, "Pirates", "New Chat in Folder")
    session = w.focused_pane.session
    conv = w.store.get_conversation(session.id)
    assert conv.folder_id == folder.id
    assert session.settings == settings and conv.settings == settings
    # a new chat with no folder chosen gets the app's defaults
    w.sidebar.folders.view.choose("__all__")
    w.new_chat()
    assert w.store.get_conversation(w.focused_pane.session.id).folder_id is None
    assert w.focused_pane.session.settings.system_prompt == ""


def test_salvage_keeps_folders_and_clears_a_dangling_one(tmp_path):
    from app.core.db_recovery import salvage

    src = Store(tmp_path / "src")
    a, b = started_chat(src, "a"), started_chat(src, "b")
    keep = src.create_folder("Keep")
    src.move_to_folder([a], keep.id)
    src.close()
    con = sqlite3.connect(tmp_path / "src" / DB_NAME)  # a folder row lost, its chat kept
    con.execute("PRAGMA foreign_keys=OFF")
    con.execute("UPDATE conversations SET folder_id='gone' WHERE id=?", (b,))
    con.commit()
    con.close()
    fresh = Store(tmp_path / "fresh")
    try:
        counts, _ = salvage(tmp_path / "src" / DB_NAME, fresh._db)
        assert counts["folders"] == 1
        assert [f.name for f in fresh.list_folders()] == ["Keep"]
        got = {c.id: c.folder_id for c in fresh.list_conversations()}
        assert got == {a: keep.id, b: None}
        assert fresh.search("hello from b") == {b}  # salvaged rows are indexed too
    finally:
        fresh.close()
