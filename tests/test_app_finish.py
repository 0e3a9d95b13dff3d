"""Issue 25 item 6, finish: the menu bar follows the dark theme, the New Folder dialog is
sized for its title with words (no stock icons) on its buttons, sent attachment chips draw
their paperclip (no emoji), a glyph a font lacks gets a substitute, and the API server's
sessions have a colour no chat has."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import (
    QFont,
    QFontMetrics,
    QGuiApplication,
    QTextDocument,
    QTextImageFormat,
)
from PySide6.QtWidgets import QDialogButtonBox, QLineEdit, QPushButton

from app.chat.attachment_bar import chips_html
from app.core.attachments import Attachment
from app.core.store import Store
from app.server.routes import SESSION_PREFIX, session_for
from app.ui import colors, icons
from app.ui.theme import theme_manager
from tests.app_helpers import engineless_window
from tests.user_path import answer_modal


@pytest.fixture
def window(qtbot, qasync_loop, app_env, restores_the_style):
    theme_manager().apply("light")  # as the app does at launch
    with engineless_window(qtbot, Store(app_env), size=(1280, 800)) as w:
        yield w


@pytest.mark.parametrize("theme, dark", [("dark", True), ("light", False)])
def test_the_menu_bar_follows_the_theme(window, qtbot, theme, dark):
    """Offscreen the old bar was dark already; on X11 (the walk-through) it stayed light,
    which tests/walkthrough_driver.py checks on its screenshots' pixels."""
    with qtbot.waitSignal(theme_manager().changed):
        window.theme_actions[theme].trigger()  # View ▸ Theme
    bar = window.menuBar()
    bar.repaint()
    image = bar.grab().toImage()
    # an empty stretch of the bar, right of the last menu
    last = bar.actionGeometry(bar.actions()[-1])
    x = (last.right() + bar.width()) // 2
    lightness = image.pixelColor(x * image.width() // bar.width(),
                                 image.height() // 2).lightness()
    assert lightness < 80 if dark else lightness > 200, lightness


def test_the_new_folder_dialog_fits_its_title_and_has_no_stock_icons(window, qtbot):
    seen = {}

    def answer(dialog) -> None:
        title_width = QFontMetrics(QGuiApplication.font()).horizontalAdvance(
            dialog.windowTitle())
        # the title plus a window manager's buttons (about 3 x 32 px) and margins
        seen["width"], seen["title"] = dialog.width(), title_width
        seen["icons"] = [b.text() for b in dialog.findChildren(QPushButton)
                         if not b.icon().isNull()]
        qtbot.keyClicks(dialog.findChild(QLineEdit), "Research")
        box = dialog.findChild(QDialogButtonBox)
        seen["ok"] = box.button(QDialogButtonBox.StandardButton.Ok).text()
        qtbot.mouseClick(box.button(QDialogButtonBox.StandardButton.Ok),
                         Qt.MouseButton.LeftButton)

    panel = window.sidebar.folders
    answer_modal(qtbot, lambda: qtbot.mouseClick(panel.new_button, Qt.MouseButton.LeftButton),
                 answer)
    assert seen["width"] >= seen["title"] + 3 * 32 + 160, seen
    assert seen["icons"] == [], seen["icons"]
    assert seen["ok"] == "Create"
    assert [f.name for f in window.store.list_folders()] == ["Research"]


def test_a_sent_messages_attachment_chip_draws_its_paperclip(qapp):
    doc = QTextDocument()
    doc.setDefaultFont(QGuiApplication.font())
    doc.setHtml(chips_html([Attachment(name="notes.md", kind="text", text="# hi")], "#eeeeee"))
    fm = QFontMetrics(doc.defaultFont())
    text = doc.toPlainText().replace("\ufffc", "")  # the image's object character
    missing = [hex(ord(c)) for c in text if not c.isspace() and not fm.inFontUcs4(ord(c))]
    assert not missing, f"characters the font lacks (drawn as boxes): {missing}"
    images = []
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fmt = it.fragment().charFormat()
            if fmt.isImageFormat():
                images.append(QTextImageFormat(fmt).name())
            it += 1
        block = block.next()
    assert len(images) == 1 and "notes.md" in text
    color = QGuiApplication.palette().text().color().name()
    assert images[0] == icons.data_uri("paperclip", color, 12)
    loaded = doc.resource(QTextDocument.ResourceType.ImageResource, images[0])
    assert loaded is not None and not loaded.isNull()


def test_a_glyph_the_font_lacks_gets_a_substitute(qapp):
    font = QFont(QGuiApplication.font())
    fm = QFontMetrics(font)
    assert fm.inFontUcs4(ord("x"))
    lacking = next(c for c in ("\U0001F4CE", "\U0001FAE0", "\U000E0001")
                   if not fm.inFontUcs4(ord(c)))
    assert icons.drawable(lacking, "x", font) == "x"
    assert icons.drawable("ab", "x", font) == "ab"


def test_the_api_servers_sessions_have_a_colour_no_chat_has(window):
    assert colors.API_PREFIX == SESSION_PREFIX  # the server's own session names
    chats = {hex_name(colors.accent_color(p.session.id)) for p in window.panes}
    palette = {c.lower() for c in colors.PALETTE}
    for user in (None, "alice", "bob"):
        sid = session_for(user)
        api = hex_name(colors.accent_color(sid))
        assert api not in palette and api not in chats, (sid, api)
        # the monitor paints it so, through the window's Chats view
        assert hex_name(window.chat_color(sid)) == api


def hex_name(c) -> str:
    return c.name().lower()
