"""The pane header's model picker: the local engine's model or any provider's model.

Its label is never cut: where the pane is too narrow for it on one line it wraps at word
boundaries onto a second (four panes and the monitor at 1280 px showed "Local · Sm…"), and the
combo box grows by a line (height-for-width) instead.

Its entries come from the provider registry (the model lists last fetched in Settings ▸
Providers); a chat whose model is no longer listed (the provider was removed, or its list not
fetched yet) keeps an entry for it, so opening the chat never silently changes its model.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QRect, QSize, Qt, Signal
from PySide6.QtGui import QPaintEvent
from PySide6.QtWidgets import (
    QComboBox,
    QSizePolicy,
    QStyle,
    QStyleOptionComboBox,
    QStylePainter,
    QWidget,
)

from app.core.providers import LOCAL, model_ref
from app.ui import icons


class ModelSelector(QComboBox):
    modelPicked = Signal(str)  # a model reference ("" = local), picked by the user

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("modelSelector")
        self.setAccessibleName("Model for this chat")
        self.setToolTip("The model this chat talks to: the local engine's or a provider's"
                        " (Settings ▸ Providers)")
        # a narrow pane must stay narrow (four panes and the monitor fit in 1280 px): ask for
        # a few characters' width, and wrap the label (paintEvent) rather than cut it
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.setMinimumContentsLength(3)
        policy = QSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        policy.setHeightForWidth(True)
        self.setSizePolicy(policy)
        self.setMinimumWidth(60)
        self.setMaximumWidth(360)
        self.currentTextChanged.connect(lambda _t: self.updateGeometry())
        self._filling = False
        self.activated.connect(self._activated)

    def fill(self, registry: Any, local_name: str, current: str) -> None:
        """List the local model and every provider's models; select `current`."""
        self._filling = True
        try:
            self.clear()
            self.addItem(f"Local · {local_name}", LOCAL)
            if registry is not None:
                for p in registry.providers():
                    for m in p.models:
                        self.addItem(f"{m} @ {p.name}", model_ref(p.id, m))
            i = self.findData(current)
            if i < 0:
                label = registry.label(current) if registry is not None else current
                self.addItem(label, current)
                i = self.count() - 1
            self.setCurrentIndex(i)
        finally:
            self._filling = False

    def current_ref(self) -> str:
        return self.currentData() or LOCAL

    def select_ref(self, ref: str) -> bool:
        """Pick `ref` as the user would (tests and keyboard users); False if not listed."""
        i = self.findData(ref)
        if i < 0:
            return False
        self.setCurrentIndex(i)
        self._activated(i)
        return True

    def _activated(self, index: int) -> None:
        if not self._filling:
            self.modelPicked.emit(self.itemData(index) or LOCAL)

    # ---- a label that wraps instead of being cut ----------------------------------------------

    def _text_rect(self, width: int, height: int) -> QRect:
        opt = QStyleOptionComboBox()
        self.initStyleOption(opt)
        opt.rect = QRect(0, 0, width, height)
        return self.style().subControlRect(
            QStyle.ComplexControl.CC_ComboBox, opt, QStyle.SubControl.SC_ComboBoxEditField, self
        )

    def display_text(self) -> str:
        """The label as painted: wrapped at spaces only, so hyphens are made non-breaking
        ("SmolLM2-135M-" / "Instruct" read as a word cut in two), where the font has one."""
        return self.currentText().replace("-", icons.drawable("\u2011", "-", self.font()))

    def _lines_at(self, width: int) -> int:
        one = super().sizeHint().height()
        text_width = self._text_rect(width, one).width()
        flags = int(Qt.TextFlag.TextWordWrap)
        rect = self.fontMetrics().boundingRect(QRect(0, 0, max(1, text_width), 10_000), flags,
                                               self.display_text())
        return max(1, round(rect.height() / max(1, self.fontMetrics().lineSpacing())))

    def sizeHint(self) -> QSize:
        """Wide enough for the whole label on one line (the layout may give it less)."""
        one = super().sizeHint()
        chrome = 400 - self._text_rect(400, one.height()).width()
        width = min(self.maximumWidth(),
                    chrome + self.fontMetrics().horizontalAdvance(self.currentText()) + 4)
        return QSize(width, self.heightForWidth(width))

    def hasHeightForWidth(self) -> bool:
        return True

    def heightForWidth(self, width: int) -> int:
        extra = (self._lines_at(width) - 1) * self.fontMetrics().lineSpacing()
        return super().sizeHint().height() + extra

    def is_elided(self) -> bool:
        """Whether a word of the label is wider than the room it has (the rest wraps)."""
        room = self._text_rect(self.width(), self.height()).width()
        fm = self.fontMetrics()
        return any(fm.horizontalAdvance(word) > room for word in self.display_text().split())

    def paintEvent(self, _event: QPaintEvent) -> None:
        p = QStylePainter(self)
        opt = QStyleOptionComboBox()
        self.initStyleOption(opt)
        text, opt.currentText = self.display_text(), ""
        p.drawComplexControl(QStyle.ComplexControl.CC_ComboBox, opt)
        p.drawControl(QStyle.ControlElement.CE_ComboBoxLabel, opt)  # the icon, if any
        rect = self._text_rect(self.width(), self.height())
        p.setPen(self.palette().color(self.foregroundRole()))
        p.drawText(rect, int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter
                             | Qt.TextFlag.TextWordWrap), text)
