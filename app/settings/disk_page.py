"""Settings ▸ Memory: the KV disk tier's budget, what it holds, and a button to clear it.

Chats sleep on disk (docs/ARCHITECTURE.md §3.14): their KV blocks are kept in the cache
folder so a reopened conversation continues without being read again. The page shows the
tier as the engine's last snapshot saw it (no file is walked in the GUI thread) and clears
it through the engine, whose writer thread deletes the files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtWidgets import QDoubleSpinBox, QFormLayout, QLabel, QPushButton, QWidget

MIB = 2**20


def describe(stats: Any, budget_mib: float) -> str:
    """One sentence about the tier (``DiskStats`` or None when it is off)."""
    if budget_mib <= 0:
        return "Off: every reopened chat is read again by the model."
    if stats is None:
        return "On after the next engine start."
    text = (f"Holds {stats.bytes / MIB:,.0f} MiB in {stats.files:,} blocks "
            f"({stats.blocks:,} for the loaded model) in {stats.folder}; "
            f"{stats.hits:,} blocks read back instead of recomputed.")
    if stats.error:
        text += f" {stats.error}"
    return text


class DiskCachePage(QWidget):
    def __init__(self, budget_mib: float, stats: Any = None,
                 on_clear: Callable[[], None] | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._stats = stats
        self._on_clear = on_clear
        f = QFormLayout(self)
        self.budget_spin = QDoubleSpinBox()
        self.budget_spin.setRange(0, 1 << 24)
        self.budget_spin.setDecimals(0)
        self.budget_spin.setSingleStep(512)
        self.budget_spin.setSuffix(" MiB")
        self.budget_spin.setSpecialValueText("Off")
        self.budget_spin.setValue(budget_mib)
        self.budget_spin.setAccessibleName("Disk cache budget")
        f.addRow("&Disk cache budget:", self.budget_spin)
        self.holds = QLabel()
        self.holds.setWordWrap(True)
        self.holds.setAccessibleName("What the disk cache holds")
        f.addRow(self.holds)
        self.clear_button = QPushButton("&Clear the disk cache")
        self.clear_button.setAccessibleName("Clear the disk cache")
        self.clear_button.setEnabled(stats is not None and on_clear is not None)
        self.clear_button.clicked.connect(self._clear)
        f.addRow(self.clear_button)
        hint = QLabel("Chats sleep on disk: their context is kept in this cache so a reopened "
                      "conversation continues at once, without being read again. Incognito "
                      "chats never reach it. Changing the budget restarts the engine.")
        hint.setObjectName("hint")
        hint.setWordWrap(True)
        f.addRow(hint)
        self.budget_spin.valueChanged.connect(self._update)
        self._update()

    def _update(self, *_args: object) -> None:
        self.holds.setText(describe(self._stats, self.budget_spin.value()))

    def _clear(self) -> None:
        if self._on_clear is not None:
            self._on_clear()
        self.clear_button.setEnabled(False)
        self.holds.setText("Cleared: the cache folder is being emptied.")

    def value(self) -> float:
        return float(self.budget_spin.value())
