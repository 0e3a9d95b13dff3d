"""A one-line label that never asks for more width than its layout gives it.

A plain QLabel's minimum width is its text's width, so a status line whose text grows (a
footer updated while a reply streams) would widen its pane, the splitter and the window. This
one asks for no minimum width and ends its text with "…" when there is not room.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QFont, QFontMetrics, QPainter, QTextLayout, QTextOption
from PySide6.QtWidgets import QLabel, QSizePolicy, QStyle, QStyleOption


class ElidedLabel(QLabel):
    def __init__(self, text: str = "", parent: Any = None) -> None:
        super().__init__(text, parent)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

    def minimumSizeHint(self) -> QSize:
        return QSize(0, super().minimumSizeHint().height())

    def sizeHint(self) -> QSize:
        return QSize(0, super().sizeHint().height())

    def is_elided(self) -> bool:
        return self.fontMetrics().horizontalAdvance(self.text()) > self.contentsRect().width()

    def displayed_text(self) -> str:
        """What is painted: the text, elided to the label's width."""
        return self.fontMetrics().elidedText(
            self.text(), Qt.TextElideMode.ElideRight, self.contentsRect().width()
        )

    def paintEvent(self, event: Any) -> None:
        p = QPainter(self)
        opt = QStyleOption()
        opt.initFrom(self)
        self.style().drawPrimitive(QStyle.PrimitiveElement.PE_Widget, opt, p, self)
        p.setPen(self.palette().color(self.foregroundRole()))
        p.setFont(self.font())
        p.drawText(self.contentsRect(), int(self.alignment()), self.displayed_text())
        p.end()


def wrapped_lines(text: str, font: QFont, width: int, max_lines: int) -> tuple[list[str], bool]:
    """`text` broken into lines of at most `width` px at word boundaries (never inside a
    word), at most `max_lines` of them; the last one ends in "…" when the rest does not fit
    (then the second value is True). A word wider than a line is elided, not broken."""
    layout = QTextLayout(text, font)
    option = QTextOption()
    option.setWrapMode(QTextOption.WrapMode.WordWrap)
    layout.setTextOption(option)
    spans: list[tuple[int, int]] = []
    layout.beginLayout()
    while True:
        line = layout.createLine()
        if not line.isValid():
            break
        line.setLineWidth(max(1, width))
        spans.append((line.textStart(), line.textLength()))
    layout.endLayout()
    fm = QFontMetrics(font)
    lines: list[str] = []
    elided = False
    for i, (start, length) in enumerate(spans):
        last = i == max_lines - 1
        piece = (text[start:] if last else text[start:start + length]).strip()
        shown = fm.elidedText(piece, Qt.TextElideMode.ElideRight, max(1, width))
        elided = elided or shown != piece
        lines.append(shown)
        if last:
            break
    return lines, elided
