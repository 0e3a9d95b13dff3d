"""Keeps the KV monitor dock from crowding the chats out of a small window.

A dock keeps its width while a QMainWindow shrinks, so at 800 px the monitor took half the
window and the panes were left one word wide. Here the docked monitor is capped to a share
of the window's width, and below `HIDE_BELOW` px it is hidden, with a status-bar hint; it
comes back by itself when the window is widened again (unless the user hid it meanwhile), and
the Monitor button / Ctrl+Shift+M show it at any size.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt, QTimer
from PySide6.QtWidgets import QDockWidget, QMainWindow

HINT = "The KV monitor is hidden to make room: Monitor (Ctrl+Shift+M) shows it."
HIDE_BELOW = 1000  # window width (px) under which the monitor steps aside
MAX_SHARE = 0.34  # of the window's width, for a docked (right-hand) monitor


class DockFitter(QObject):
    def __init__(self, window: QMainWindow, dock: QDockWidget) -> None:
        super().__init__(window)
        self.window = window
        self.dock = dock
        self.auto_hidden = False
        self._pending: str | None = None  # "hide" / "show", decided when the size changed
        self._fitting = False
        dock.visibilityChanged.connect(self._visibility_changed)
        window.installEventFilter(self)

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if obj is self.window and event.type() == QEvent.Type.Resize:
            old, new = event.oldSize().width(), event.size().width()
            if old >= HIDE_BELOW > new:
                self._pending = "hide"
            elif new >= HIDE_BELOW and (self.auto_hidden or self._pending == "hide"):
                self._pending = "show"
            QTimer.singleShot(0, self, self.fit)
        return False

    def _visibility_changed(self, visible: bool) -> None:
        if not visible:
            return  # (also what a dock says while its window is being destroyed)
        bar = self.window.statusBar()
        if bar.currentMessage() == HINT:
            bar.clearMessage()  # the hint no longer holds
        if not self._fitting:
            self.auto_hidden = False  # the user showed it: it stays, at any size
            if self._pending == "hide":
                self._pending = None
            QTimer.singleShot(0, self, self._cap)

    def fit(self) -> None:
        pending, self._pending = self._pending, None
        self._fitting = True
        try:
            if pending == "hide" and not self.dock.isFloating() and self.dock.isVisible():
                self.dock.hide()
                self.auto_hidden = True
                self.window.statusBar().showMessage(HINT, 8000)
            elif pending == "show" and self.auto_hidden:
                self.auto_hidden = False
                self.dock.show()
        finally:
            self._fitting = False
        self._cap()

    def _cap(self) -> None:
        dock = self.dock
        if dock.isFloating() or not dock.isVisible():
            return
        if self.window.dockWidgetArea(dock) != Qt.DockWidgetArea.RightDockWidgetArea:
            return
        cap = max(dock.minimumSizeHint().width(), int(self.window.width() * MAX_SHARE))
        if dock.width() > cap:
            self.window.resizeDocks([dock], [cap], Qt.Orientation.Horizontal)
