"""The message composer: Enter sends, Shift+Enter inserts a line, Esc cancels an edit.

It grows with its content up to `MAX_LINES` lines, then scrolls, like the text field of a Mac
chat app. Plain text only: pasted rich text is stripped.
"""

from __future__ import annotations

from PySide6.QtCore import QMimeData, QSize, Qt, Signal
from PySide6.QtGui import QKeyEvent, QResizeEvent
from PySide6.QtWidgets import QPlainTextEdit, QSizePolicy, QWidget

MAX_LINES = 8


class InputBox(QPlainTextEdit):
    submitted = Signal(str)
    cancelled = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("inputBox")
        self.setAccessibleName("Message input")
        self.setAccessibleDescription("Enter sends; Shift+Enter starts a new line.")
        self.setPlaceholderText("Message…")
        self.setTabChangesFocus(True)
        self.setFrameShape(QPlainTextEdit.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self._fit()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submitted.emit(self.toPlainText())
            event.accept()
            return
        if event.key() == Qt.Key.Key_Escape:
            self.cancelled.emit()
            event.accept()
            return
        super().keyPressEvent(event)

    def insertFromMimeData(self, source: QMimeData) -> None:
        if source.hasText():
            self.insertPlainText(source.text())

    def wrapped_line_count(self) -> int:
        """Lines the text takes at the box's present width, from the document's own layout
        of every paragraph (its size lags a width change, as it lays out only what it shows:
        a pane made narrower kept a box of the old height, its last line cut in half behind
        a scroll bar)."""
        doc = self.document()
        layout = doc.documentLayout()
        lines = 0
        block = doc.begin()
        while block.isValid():
            layout.ensureBlockLayout(block)
            lines += max(1, block.layout().lineCount())
            block = block.next()
        return max(1, lines)

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        if event.oldSize().width() != event.size().width():
            self._fit()  # the same text takes more or fewer lines now

    def _fit(self, *_args: object) -> None:
        line = self.fontMetrics().lineSpacing()
        lines = min(MAX_LINES, self.wrapped_line_count())
        margins = self.contentsMargins()
        doc_margin = self.document().documentMargin()
        h = int(lines * line + 2 * doc_margin + margins.top() + margins.bottom()) + 2
        self.setFixedHeight(h)

    def sizeHint(self) -> QSize:
        return QSize(200, self.height())
