"""The banner that tells the user when chats cannot be saved, or were recovered at open.

The store holds writes in memory while the disk misbehaves and reports its state from its
retry thread; this widget re-emits that through a queued signal so only the GUI thread
touches widgets. A recovery notice (a damaged database moved aside at open) stays until the
user dismisses it, since it names the file they may want to keep.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QBoxLayout, QFrame, QHBoxLayout, QLabel, QPushButton, QWidget


def save_problem_text(problem: str, pending: int) -> str:
    held = f" {pending} change(s) are kept in memory" if pending else " Nothing is lost"
    return (
        f"Chats can't be saved: {problem}. Retrying;{held} while PagedChat stays open, "
        "and written as soon as saving works again."
    )


class StorageBanner(QFrame):
    stateArrived = Signal(object)  # a SaveState, from whichever thread noticed the change

    def __init__(self, store: Any, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("storageBanner")
        self.setAccessibleName("Storage status")
        self.store = store
        h = QHBoxLayout(self)
        h.setContentsMargins(14, 8, 10, 8)
        self.label = QLabel()
        self.label.setObjectName("storageBannerText")
        self.label.setAccessibleName("Storage status message")
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        h.addWidget(self.label, 1)
        self.retry = QPushButton("Retry Now")
        self.retry.setAccessibleName("Retry saving now")
        self.retry.clicked.connect(store.retry_saving)
        h.addWidget(self.retry)
        self.dismiss = QPushButton("Dismiss")
        self.dismiss.setAccessibleName("Dismiss the recovery notice")
        self.dismiss.clicked.connect(self._dismiss)
        h.addWidget(self.dismiss)
        recovery = getattr(store, "recovery", None)
        self._notice: str | None = recovery.message() if recovery is not None else None
        self._problem: str | None = None
        self.stateArrived.connect(self._on_state, Qt.ConnectionType.QueuedConnection)
        store.add_save_listener(self.stateArrived.emit)
        self._on_state(store.save_state)

    @property
    def problem(self) -> str | None:
        """The cause shown while saving fails ("disk full"), else None."""
        return self._problem

    def _on_state(self, state: Any) -> None:
        self._problem = state.problem
        if state.problem is not None:
            self._show("error", save_problem_text(state.problem, state.pending), retry=True)
        elif self._notice:
            self._show("warning", self._notice, retry=False)
        else:
            self.hide()

    def _show(self, kind: str, text: str, retry: bool) -> None:
        self.setProperty("kind", kind)
        self.label.setText(text)
        self.retry.setVisible(retry)
        self.dismiss.setVisible(not retry)
        self.style().unpolish(self)
        self.style().polish(self)
        self.show()

    def _dismiss(self) -> None:
        self._notice = None
        self._on_state(self.store.save_state)


def attach_storage_banner(window: Any) -> StorageBanner:
    """Put a StorageBanner for `window.store` at the top of the window's workspace."""
    banner = StorageBanner(window.store, window.workspace)
    layout = window.workspace.layout()
    if isinstance(layout, QBoxLayout):
        layout.insertWidget(0, banner)
    return banner
