"""Attachments on the user's path: Attach… through the real file dialog, a file dropped on the
input, chips (✕ removes), a binary file refused with a notice, the files sent with the
message (stored, shown as chips on it, in the prompt); with the real engine, the token count
and the warning when the files exceed the context left."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDragMoveEvent, QDropEvent
from PySide6.QtWidgets import (
    QApplication,
    QDialogButtonBox,
    QFileDialog,
    QLineEdit,
    QToolButton,
)

from app.core.attachments import from_meta
from app.core.store import Store
from tests.app_helpers import WAIT_MS, engineless_window, open_window
from tests.user_path import answer_modal, type_and_send


@pytest.fixture
def window(qtbot, qasync_loop, app_env):
    with engineless_window(qtbot, Store(app_env)) as w:
        yield w


def attach_by_dialog(qtbot, pane, folder, name: str) -> None:
    def answer(dialog) -> None:
        assert isinstance(dialog, QFileDialog)
        dialog.setDirectory(str(folder))  # (the folder the user browsed to)
        edit = dialog.findChild(QLineEdit, "fileNameEdit")
        qtbot.keyClicks(edit, name)
        box = dialog.findChild(QDialogButtonBox, "buttonBox")
        accept = next(b for b in box.buttons()
                      if box.buttonRole(b) == QDialogButtonBox.ButtonRole.AcceptRole)
        popup = edit.completer().popup()

        def click() -> bool:
            if popup.isVisible():
                qtbot.keyClick(popup, Qt.Key.Key_Escape)
            else:
                assert accept.isEnabled(), (edit.text(), dialog.directory().path())
                qtbot.mouseClick(accept, Qt.MouseButton.LeftButton)
            return not dialog.isVisible()

        qtbot.waitUntil(click, timeout=10000)

    bar = pane.attachments
    answer_modal(qtbot, lambda: qtbot.mouseClick(bar.attach_button, Qt.MouseButton.LeftButton),
                 answer)


def drop_files(widget, paths) -> QDropEvent:
    """Drag files from a file manager onto `widget`: enter, move, drop (Qt delivers a drop
    only to where a drag entered)."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    pos = QPointF(widget.rect().center())
    args = (pos, Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
            Qt.KeyboardModifier.NoModifier)
    enter = QDragEnterEvent(*args)
    QApplication.sendEvent(widget, enter)
    assert enter.isAccepted()
    QApplication.sendEvent(widget, QDragMoveEvent(*args))
    drop = QDropEvent(*args)
    QApplication.sendEvent(widget, drop)
    assert drop.isAccepted()
    return drop


def chip_names(pane) -> list[str]:
    return [c.text().removesuffix("  ✕") for c in pane.attachments.findChildren(QToolButton)
            if c.objectName() == "attachmentChip" and c.isVisibleTo(pane)]


def test_attach_drop_remove_refuse_and_send(window, qtbot, tmp_path):
    pane = window.focused_pane
    (tmp_path / "notes.md").write_text("# Notes\nthe wombat digs burrows\n", encoding="utf-8")
    (tmp_path / "main.py").write_text("print('hi')\n", encoding="utf-8")
    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    attach_by_dialog(qtbot, pane, tmp_path, "notes.md")
    attach_by_dialog(qtbot, pane, tmp_path, "main.py")
    qtbot.waitUntil(lambda: chip_names(pane) == ["notes.md", "main.py"])
    assert "2 files" in pane.attachments.status.text()
    assert "characters" in pane.attachments.status.text()  # no model: no token guess
    # a binary file dropped on the input is refused, with a notice saying why
    drop_files(pane.input.viewport(), [tmp_path / "photo.png"])
    qtbot.waitUntil(lambda: pane.notice_label.isVisible())
    assert "photo.png is a binary file" in pane.notice_label.text()
    assert chip_names(pane) == ["notes.md", "main.py"]
    # a click on a chip removes it; a text file dropped is attached
    chip = next(c for c in pane.attachments.findChildren(QToolButton)
                if c.text().startswith("main.py"))
    qtbot.mouseClick(chip, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: chip_names(pane) == ["notes.md"])
    drop_files(pane.input.viewport(), [tmp_path / "main.py"])
    qtbot.waitUntil(lambda: chip_names(pane) == ["notes.md", "main.py"])
    assert pane.input.toPlainText() == ""  # dropped files are attached, not pasted

    type_and_send(qtbot, pane, "What digs?")
    qtbot.waitUntil(lambda: chip_names(pane) == [])
    user = pane.session.active_path()[0]
    stored = window.store.get_message(user.id)
    assert stored.content == "What digs?"
    assert [a.name for a in from_meta(stored.meta)] == ["notes.md", "main.py"]
    prompt = pane.session.prompt_messages(user.id)[-1]["content"]
    assert "Attached file: notes.md" in prompt and "the wombat digs burrows" in prompt
    doc = pane.model.index(pane.model.row_of(user.id)).data(Qt.ItemDataRole.DisplayRole)
    assert doc == "What digs?"
    rendered = pane.model.entry(pane.model.row_of(user.id)).doc.toPlainText()
    # the chips on the message: the drawn paperclip (an image, U+FFFC in the text), no emoji
    assert "\ufffc notes.md" in rendered and "\ufffc main.py" in rendered
    assert "📎" not in rendered
    # and the attached text is found by search, pointing at the message
    hits = window.store.search_hits("wombat")
    assert [(h.message_id, h.role) for h in hits] == [(user.id, "attachment")]


def test_an_edited_message_keeps_its_files(window, qtbot, tmp_path):
    pane = window.focused_pane
    (tmp_path / "data.csv").write_text("a,b\n1,2\n", encoding="utf-8")
    drop_files(pane.input.viewport(), [tmp_path / "data.csv"])
    type_and_send(qtbot, pane, "Sum the columns")
    first = pane.session.active_path()[0]
    assert pane.session.edit_and_resend(first.id, "Average the columns")
    edited = pane.session.active_path()[0]
    assert edited.id != first.id and edited.parent_id == first.parent_id
    stored = window.store.get_message(edited.id)
    assert [(a.name, a.text) for a in from_meta(stored.meta)] == [("data.csv", "a,b\n1,2\n")]


@pytest.mark.slow
def test_token_count_and_the_over_context_warning(qtbot, qasync_loop, app_env, app_engine,
                                                  tmp_path):
    h = open_window(qtbot, app_env, app_engine)
    try:
        pane = h.window.focused_pane
        small = tmp_path / "small.txt"
        small.write_text("Paged attention keeps the KV cache in blocks.\n", encoding="utf-8")
        drop_files(pane.input.viewport(), [small])
        bar = pane.attachments
        qtbot.waitUntil(lambda: bar.tokens is not None, timeout=WAIT_MS)
        expected = app_engine.count_tokens([{"role": "user", "content":
                                             f"Attached file: small.txt\n```\n"
                                             f"{small.read_text().rstrip()}\n```"}])
        assert bar.tokens == expected and f"{expected:,} tokens" in bar.status.text()
        assert not bar.over_context
        big = tmp_path / "big.txt"
        limit = h.bridge.max_context
        big.write_text("word " * (limit + 100), encoding="utf-8")
        drop_files(pane.input.viewport(), [big])
        qtbot.waitUntil(lambda: bar.over_context, timeout=WAIT_MS)
        assert bar.status.text().startswith("⚠") and "more than the" in bar.status.text()
    finally:
        h.close()


def test_the_attach_button_draws_every_character_it_shows(window):
    """The button showed "📎 Attach…", and where the font has no paperclip (most Linux
    desktops) the user saw an empty box: its text must be drawable in its own font, and the
    paperclip is a drawn icon that follows the theme."""
    from PySide6.QtGui import QFontMetrics, QPalette

    button = window.focused_pane.attachments.attach_button
    metrics = QFontMetrics(button.font())
    missing = [ch for ch in button.text() if not metrics.inFontUcs4(ord(ch))]
    assert not missing, f"characters the font cannot draw: {missing}"
    assert not button.icon().isNull()
    before = button.icon().pixmap(14).toImage()
    app = QApplication.instance()
    palette = app.palette()
    inverted = QPalette(palette)
    inverted.setColor(QPalette.ColorRole.ButtonText, Qt.GlobalColor.red)
    app.setPalette(inverted)
    try:
        window.focused_pane.refresh_icons()
        assert button.icon().pixmap(14).toImage() != before
    finally:
        app.setPalette(palette)
        window.focused_pane.refresh_icons()
