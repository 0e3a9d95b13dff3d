"""The library on the user's path: File ▸ Export Chat… / Export All Chats… / Import Chats…
through the real (Qt, non-native) file dialog, typed into and confirmed with its button."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QDialogButtonBox, QFileDialog, QLineEdit, QMessageBox

from app.bridges.engine_bridge import EngineBridge
from app.core import exchange
from app.core.store import Store
from app.library import dialogs as library_dialogs
from app.window.main_window import MainWindow
from tests.library_helpers import build_chat, canonical
from tests.user_path import answer_modal


@pytest.fixture
def library(qtbot, qasync_loop, app_env, tmp_path):
    store = Store(app_env)
    ids = build_chat(store)
    store.set_value(library_dialogs.FOLDER_KEY, str(tmp_path))  # where the user saved last
    w = MainWindow(store, EngineBridge())  # no engine: nothing here needs the model
    qtbot.addWidget(w)
    w.show()
    w.open_chat(ids["conv"])
    yield w, store, ids
    w.shutdown_chats()
    store.close()


def file_menu_action(window, text: str):
    menu = next(a.menu() for a in window.menuBar().actions() if a.text() == "&File")
    return next(a for a in menu.actions() if a.text().replace("&", "") == text)


def fill_file_dialog(qtbot, dialog, path, file_type: str | None = None) -> None:
    """Pick a file type from the dialog's list with the arrow keys, type the file name (the
    dialog opens in the folder used last), click Save or Open."""
    try:
        _fill(qtbot, dialog, path, file_type)
    except BaseException:
        dialog.reject()  # a failed step fails the test instead of leaving the dialog open
        raise


def _fill(qtbot, dialog, path, file_type: str | None) -> None:
    assert isinstance(dialog, QFileDialog)
    assert dialog.testOption(QFileDialog.Option.DontUseNativeDialog)
    if file_type is not None:
        combo = dialog.findChild(QComboBox, "fileTypeCombo")
        types = [combo.itemText(i) for i in range(combo.count())]
        target = next(i for i, t in enumerate(types) if t.startswith(file_type))
        combo.setFocus()
        while combo.currentIndex() < target:
            qtbot.keyClick(combo, Qt.Key.Key_Down)
        assert dialog.selectedNameFilter().startswith(file_type)
    edit = dialog.findChild(QLineEdit, "fileNameEdit")
    edit.setFocus()
    qtbot.keyClick(edit, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)
    assert Path(dialog.directory().path()) == path.parent  # the folder used last time
    qtbot.keyClicks(edit, path.name)
    box = dialog.findChild(QDialogButtonBox, "buttonBox")
    accept = next(b for b in box.buttons()
                  if box.buttonRole(b) == QDialogButtonBox.ButtonRole.AcceptRole)
    popup = edit.completer().popup()

    def click_accept() -> bool:
        """Click Save / Open; the path completer's list, which the file system model may
        open a moment after typing and which takes the click, is closed first with Esc."""
        if popup.isVisible():
            qtbot.keyClick(popup, Qt.Key.Key_Escape)
        else:
            assert accept.isEnabled(), accept.text()
            qtbot.mouseClick(accept, Qt.MouseButton.LeftButton)
        return not dialog.isVisible()

    qtbot.waitUntil(click_accept, timeout=10000)


def test_export_a_chat_as_html_and_as_json_then_import_it(library, qtbot, tmp_path):
    window, store, ids = library
    export = file_menu_action(window, "Export Chat…")

    answer_modal(qtbot, export.trigger,
                 lambda d: fill_file_dialog(qtbot, d, tmp_path / "page", "HTML, every branch"))
    page = (tmp_path / "page.html").read_text(encoding="utf-8")  # the suffix was added
    for text in ("first question", "reply one", "reply three", "answer to the follow-up"):
        assert text in page
    assert '<span class="k">def</span>' in page

    answer_modal(qtbot, export.trigger,
                 lambda d: fill_file_dialog(qtbot, d, tmp_path / "chat.json", "JSON"))
    assert (tmp_path / "chat.json").exists()

    answer_modal(qtbot, file_menu_action(window, "Import Chats…").trigger,
                 lambda d: fill_file_dialog(qtbot, d, tmp_path / "chat.json"))
    convs = store.list_conversations()
    assert len(convs) == 2
    new = next(c.id for c in convs if c.id != ids["conv"])
    assert canonical(store, new) == canonical(store, ids["conv"])
    # the imported chat is listed and opened in the focused pane, its shown branch on screen
    assert new in window.sidebar.visible_ids()
    pane = window.focused_pane
    assert pane.session.id == new
    shown = [pane.model.index(r).data(Qt.ItemDataRole.DisplayRole)
             for r in range(pane.model.rowCount())]
    assert shown == canonical(store, ids["conv"])["shown"]


def test_a_malformed_import_shows_why_and_imports_nothing(library, qtbot, tmp_path):
    window, store, ids = library
    good = exchange.to_json_text([exchange.load_chat(store, ids["conv"])])
    bad = tmp_path / "cut.json"
    bad.write_text(good[:200], encoding="utf-8")
    texts: list[str] = []

    def answer(dialog) -> None:
        if isinstance(dialog, QFileDialog):
            fill_file_dialog(qtbot, dialog, bad)
        else:
            assert isinstance(dialog, QMessageBox)
            texts.append(dialog.text())
            qtbot.mouseClick(dialog.buttons()[0], Qt.MouseButton.LeftButton)

    answer_modal(qtbot, file_menu_action(window, "Import Chats…").trigger, answer)
    assert texts and texts[0].startswith("Nothing was imported.")
    assert "cut.json" in texts[0] and "not valid JSON" in texts[0]
    assert [c.id for c in store.list_conversations()] == [ids["conv"]]


def test_export_all_chats_into_a_zip(library, qtbot, tmp_path):
    window, store, ids = library
    build_chat(store, "second chat")
    answer_modal(qtbot, file_menu_action(window, "Export All Chats…").trigger,
                 lambda d: fill_file_dialog(qtbot, d, tmp_path / "backup", "JSON files in a zip"))
    with zipfile.ZipFile(tmp_path / "backup.zip") as z:
        names = sorted(z.namelist())
    assert names == ["Trees tags.json", "second chat.json"]
    assert "2 chats" in window.statusBar().currentMessage()
