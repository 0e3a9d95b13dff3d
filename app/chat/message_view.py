"""The message list of a chat pane: scrolling, hover, clicks, keyboard and context menu.

All hit-testing goes through MessageDelegate.geometry (the same geometry it paints with).
A click on a code block's "Copy" link (an anchor `copy:N` in the rendered document) puts that
block's code on the clipboard; other links open in the browser. Message actions are emitted as
`actionRequested(message_id, action)` for the pane to carry out. The list sticks to the bottom
while a reply streams, unless the user scrolled up.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QPoint, QPointF, QRect, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QAction,
    QContextMenuEvent,
    QDesktopServices,
    QGuiApplication,
    QKeyEvent,
    QKeySequence,
    QMouseEvent,
)
from PySide6.QtWidgets import QAbstractItemView, QListView, QMenu, QToolTip, QWidget

from app.chat.delegate import ACTION_TIPS, MessageDelegate, RowGeometry
from app.chat.markdown import COPY_SCHEME
from app.chat.message_model import TOGGLE_SCHEME, ChatMessageModel
from app.core.records import Status
from app.ui.qt_util import disconnect


class MessageListView(QListView):
    actionRequested = Signal(str, str)  # message id, action name
    regenerateMany = Signal(str, int)  # message id, number of alternatives
    codeCopied = Signal(str)  # the code text put on the clipboard

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("messageList")
        self.setAccessibleName("Messages")
        self.setAccessibleDescription(
            "Conversation messages. Arrow keys move between messages; Ctrl+C copies one; "
            "Alt+Left and Alt+Right switch alternatives; the menu key shows more actions."
        )
        self.delegate = MessageDelegate(self)
        self.setItemDelegate(self.delegate)
        self.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setResizeMode(QListView.ResizeMode.Adjust)
        self.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.setUniformItemSizes(False)
        self.setMouseTracking(True)
        self.setFrameShape(QListView.Shape.NoFrame)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.verticalScrollBar().setSingleStep(24)
        self.hover_row = -1
        self.hover_action: str | None = None
        self._stick = True
        self.verticalScrollBar().valueChanged.connect(self._scrolled)
        self.verticalScrollBar().rangeChanged.connect(self._range_changed)

    def setModel(self, model: ChatMessageModel | None) -> None:  # type: ignore[override]
        old = self.model()
        if old is not None:
            for sig in (old.rowsInserted, old.dataChanged, old.layoutChanged):
                disconnect(sig, self._content_changed)
        super().setModel(model)
        if model is not None:
            model.set_font(self.font())
            model.rowsInserted.connect(self._content_changed)
            model.dataChanged.connect(self._content_changed)
            model.layoutChanged.connect(self._content_changed)
            self._stick = True
            QTimer.singleShot(0, self, self.scrollToBottom)  # cancelled if the view goes

    def scroll_to_row(self, row: int) -> None:
        """Select a row and scroll it to the top (a search hit); stop following the bottom."""
        model = self.model()
        if model is None or not 0 <= row < model.rowCount():
            return
        index = model.index(row, 0)
        self._stick = False
        self.setCurrentIndex(index)
        self.scrollTo(index, QAbstractItemView.ScrollHint.PositionAtTop)

    def chat_model(self) -> ChatMessageModel:
        return self.model()  # type: ignore[return-value]

    # ---- geometry helpers (also used by tests) -------------------------------------------

    def row_geometry(self, row: int) -> RowGeometry:
        return self.delegate.geometry(self.visualRect(self.model().index(row, 0)), row)

    def anchor_at(self, pos: QPoint) -> tuple[int, str | None]:
        """(row, href) of the link under a viewport position."""
        index = self.indexAt(pos)
        if not index.isValid():
            return -1, None
        geo = self.row_geometry(index.row())
        if not geo.body.contains(pos):
            return index.row(), None
        entry = self.chat_model().entry(index.row())
        local = QPointF(pos - geo.body.topLeft())
        href = entry.doc.documentLayout().anchorAt(local)
        return index.row(), href or None

    def anchor_rect(self, row: int, href: str) -> QRect | None:
        """Viewport rectangle of the first link `href` in a row (None when absent)."""
        entry = self.chat_model().entry(row)
        geo = self.row_geometry(row)
        doc = entry.doc
        layout = doc.documentLayout()
        block = doc.begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                frag = it.fragment()
                if frag.isValid() and frag.charFormat().anchorHref() == href:
                    br = layout.blockBoundingRect(block)
                    tl = block.layout()
                    rel = frag.position() - block.position()
                    line = tl.lineForTextPosition(rel)
                    x0 = line.cursorToX(rel)[0] if line.isValid() else 0.0
                    x1 = line.cursorToX(rel + frag.length())[0] if line.isValid() else br.width()
                    y = br.top() + (line.y() if line.isValid() else 0.0)
                    h = line.height() if line.isValid() else br.height()
                    r = QRect(int(br.left() + x0), int(y), max(1, int(x1 - x0)), max(1, int(h)))
                    return r.translated(geo.body.topLeft())
                it += 1
            block = block.next()
        return None

    # ---- mouse ---------------------------------------------------------------------------

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        pos = event.position().toPoint()
        index = self.indexAt(pos)
        row = index.row() if index.isValid() else -1
        action = None
        href = None
        if row >= 0:
            action = self.row_geometry(row).hit(pos)
            if action is None:
                _, href = self.anchor_at(pos)
        if row != self.hover_row or action != self.hover_action:
            old = self.hover_row
            self.hover_row, self.hover_action = row, action
            for r in {old, row}:
                if r >= 0 and r < self.model().rowCount():
                    self.update(self.model().index(r, 0))
        pointing = action is not None or href is not None
        self.viewport().setCursor(
            Qt.CursorShape.PointingHandCursor if pointing else Qt.CursorShape.ArrowCursor
        )
        # A tooltip tied to the hovered button's rectangle stays while the pointer is on it
        # (re-showing it on every move, with no rectangle, made it vanish within a second).
        if action:
            rect = self.row_geometry(row).actions[action]
            tip = ACTION_TIPS.get(action, "")
            if not (QToolTip.isVisible() and QToolTip.text() == tip):
                QToolTip.showText(
                    event.globalPosition().toPoint(), tip, self.viewport(), rect, 60_000
                )
        elif href and href.startswith(COPY_SCHEME):
            if not (QToolTip.isVisible() and QToolTip.text() == "Copy code"):
                QToolTip.showText(event.globalPosition().toPoint(), "Copy code", self)
        elif QToolTip.isVisible() and QToolTip.text() in ACTION_TIPS.values():
            QToolTip.hideText()
        super().mouseMoveEvent(event)

    def leaveEvent(self, event: QEvent) -> None:
        old, self.hover_row, self.hover_action = self.hover_row, -1, None
        if 0 <= old < self.model().rowCount():
            self.update(self.model().index(old, 0))
        super().leaveEvent(event)

    def mouseReleaseEvent(self, event: QMouseEvent) -> None:
        if event.button() == Qt.MouseButton.LeftButton:
            pos = event.position().toPoint()
            index = self.indexAt(pos)
            if index.isValid():
                row = index.row()
                action = self.row_geometry(row).hit(pos)
                if action is not None:
                    self.actionRequested.emit(self.chat_model().message(row).id, action)
                    event.accept()
                    return
                _, href = self.anchor_at(pos)
                if href:
                    self._open_link(row, href)
                    event.accept()
                    return
        super().mouseReleaseEvent(event)

    def _open_link(self, row: int, href: str) -> None:
        if href.startswith(TOGGLE_SCHEME):
            self.chat_model().toggle(row)
        elif href.startswith(COPY_SCHEME):
            try:
                n = int(href[len(COPY_SCHEME) :])
                code = self.chat_model().entry(row).code_blocks[n]
            except (ValueError, IndexError):
                return
            QGuiApplication.clipboard().setText(code)
            QToolTip.showText(self.cursor().pos(), "Copied", self)
            self.codeCopied.emit(code)
        else:
            url = QUrl(href)
            if url.scheme() in ("http", "https", "mailto"):
                QDesktopServices.openUrl(url)

    # ---- keyboard and menu ---------------------------------------------------------------

    def keyPressEvent(self, event: QKeyEvent) -> None:
        row = self.currentIndex().row()
        if row >= 0:
            mid = self.chat_model().message(row).id
            if event.matches(QKeySequence.StandardKey.Copy):
                self.actionRequested.emit(mid, "copy")
                return
            if event.modifiers() & Qt.KeyboardModifier.AltModifier and event.key() in (
                Qt.Key.Key_Left,
                Qt.Key.Key_Right,
            ):
                self.actionRequested.emit(mid, "prev" if event.key() == Qt.Key.Key_Left else "next")
                return
        super().keyPressEvent(event)

    def contextMenuEvent(self, event: QContextMenuEvent) -> None:
        if event.reason() == QContextMenuEvent.Reason.Mouse:
            index = self.indexAt(event.pos())
        else:
            index = self.currentIndex()
        if not index.isValid():
            return
        msg = self.chat_model().message(index.row())
        busy = self.chat_model().session.busy
        menu = QMenu(self)
        menu.setAccessibleName("Message actions")

        def add(text: str, action: str, enabled: bool = True, shortcut: str = "") -> QAction:
            a = menu.addAction(text)
            a.setEnabled(enabled)
            if shortcut:
                a.setShortcut(QKeySequence(shortcut))
            a.triggered.connect(lambda: self.actionRequested.emit(msg.id, action))
            return a

        add("Copy Message", "copy", shortcut="Ctrl+C")
        if msg.role == "user":
            add("Edit and Resend…", "edit", not busy)
        else:
            add("Regenerate", "regenerate", not busy)
            sub = menu.addMenu("Regenerate Alternatives")
            sub.setEnabled(not busy)
            for n in (2, 3, 4):
                a = sub.addAction(f"{n} Alternatives")
                a.triggered.connect(lambda _c=False, n=n: self.regenerateMany.emit(msg.id, n))
        add("Branch New Chat From Here", "branch", msg.status not in Status.LIVE)
        pos, count = self.chat_model().session.tree.sibling_position(msg.id)
        if count > 1:
            menu.addSeparator()
            add("Previous Alternative", "prev", pos > 0, "Alt+Left")
            add("Next Alternative", "next", pos < count - 1, "Alt+Right")
        menu.exec(event.globalPos())

    # ---- sticking to the bottom ----------------------------------------------------------

    def _scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._stick = value >= bar.maximum() - 8

    def _range_changed(self, _lo: int, hi: int) -> None:
        if self._stick:
            self.verticalScrollBar().setValue(hi)

    def _content_changed(self, *_args: object) -> None:
        if self._stick:
            QTimer.singleShot(0, self, self.scrollToBottom)  # cancelled if the view goes

    def resizeEvent(self, event) -> None:  # noqa: ANN001
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            # QListView (top-to-bottom flow) only relays items out when the height changes;
            # row heights here follow the width (wrapped text), so relay them out now.
            self.scheduleDelayedItemsLayout()
        if self._stick:
            self.scrollToBottom()
