"""Keeps the side panels (the KV monitor dock and the sidebar) from crowding the chats out.

A dock keeps its width while a QMainWindow shrinks, so at 800 px the monitor took half the
window and the panes were left one word wide. Here:

- the docked monitor is capped to a share of the window's width (a smaller share while the
  panes are short of room), and below `HIDE_BELOW` px it is hidden, with a status-bar hint;
  it comes back by itself when the window is widened again (unless the user hid it
  meanwhile), and the Monitor button / Ctrl+Shift+M show it at any size;
- the width the monitor had before it was capped or hidden is remembered, so a window made
  small and then large again gets the monitor back at that width (it came back narrower);
- the sidebar steps aside when the panes would get less than `PANE_ROOM` px each (four panes
  and the monitor at 1280 px: 153 px panes cut every title to "What i…"), with a hint, and
  comes back when there is room again, unless the user showed or hid it meanwhile.

Each decision is a function of the window's width, the number of panes and the user's own
choices, never of the sizes the window went through: a window made small and large again
is laid out as it was.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QEvent, QObject, Qt, QTimer
from PySide6.QtWidgets import QDockWidget, QMainWindow

HINT = "The KV monitor is hidden to make room: Monitor (Ctrl+Shift+M) shows it."
SIDEBAR_HINT = "The sidebar is hidden to make room for the panes: Ctrl+Shift+S shows it."
HIDE_BELOW = 1000  # window width (px) under which the monitor steps aside
MAX_SHARE = 0.34  # of the window's width, for a docked (right-hand) monitor
CROWDED_SHARE = 0.27  # the monitor's share while the panes are short of room
PANE_ROOM = 230  # px a pane needs for its header to show a title and the model unelided


class DockFitter(QObject):
    def __init__(self, window: QMainWindow, dock: QDockWidget, sidebar: Any = None) -> None:
        super().__init__(window)
        self.window = window
        self.dock = dock
        self.sidebar = sidebar
        self.auto_hidden = False
        self.sidebar_auto_hidden = False
        self.sidebar_pinned = False  # shown by the user: it does not step aside
        self.preferred_width: int | None = None  # the monitor's width before any cap
        self._pending: str | None = None  # "hide" / "show", decided when the size changed
        self._fitting = False
        self._window_resizing = False
        self._window_width = window.width()  # as of the last fit: a change is a window resize
        self._expected: int | None = None  # a width asked of resizeDocks, not yet applied
        dock.visibilityChanged.connect(self._visibility_changed)
        dock.installEventFilter(self)
        window.installEventFilter(self)

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if obj is self.window and event.type() == QEvent.Type.Resize:
            old, new = event.oldSize().width(), event.size().width()
            if old >= HIDE_BELOW > new:
                self._pending = "hide"
            elif new >= HIDE_BELOW and (self.auto_hidden or self._pending == "hide"):
                self._pending = "show"
            self._window_resizing = True
            QTimer.singleShot(0, self, self.fit)
        elif (obj is self.dock and event.type() == QEvent.Type.Resize
              and event.size().width() != event.oldSize().width()):
            width = event.size().width()
            if width == self._expected:
                self._expected = None  # the width this class asked for
            elif (not self._window_resizing and not self._fitting and self.dock.isVisible()
                  and not self.dock.isFloating() and self.window.width() == self._window_width):
                self.preferred_width = width  # the user dragged its edge
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
            self._cap()  # before it is painted at the width it had
            QTimer.singleShot(0, self, self._cap)

    def sidebar_set_by_user(self, shown: bool) -> None:
        """The user showed or hid the sidebar: it stays so until they change it again."""
        self.sidebar_auto_hidden = False
        self.sidebar_pinned = shown
        if self.window.statusBar().currentMessage() == SIDEBAR_HINT:
            self.window.statusBar().clearMessage()

    def fit(self) -> None:
        pending, self._pending = self._pending, None
        self._window_resizing = False
        self._window_width = self.window.width()
        self._fitting = True
        try:
            if pending == "hide" and not self.dock.isFloating() and self.dock.isVisible():
                self._remember_width()
                self.dock.hide()
                self.auto_hidden = True
                self.window.statusBar().showMessage(HINT, 8000)
            elif pending == "show" and self.auto_hidden:
                self.auto_hidden = False
                self.dock.show()
            self._fit_sidebar()
        finally:
            self._fitting = False
        self._cap()

    # ---- the sidebar ---------------------------------------------------------------------

    def _pane_count(self) -> int:
        return max(1, len(getattr(self.window, "panes", ())))

    def _natural_width(self) -> int:
        """The monitor's width when the panes have room: its own (before any cap), capped."""
        own = self.preferred_width or self.dock.width()
        return min(own, self._cap_width(crowded=False))

    def _docked_width(self) -> int:
        """What the docked monitor takes from the panes when they are short of room."""
        d = self.dock
        if d.isFloating() or not d.isVisible():
            return 0
        return min(self._natural_width(), self._cap_width(crowded=True))

    def _sidebar_width(self) -> int:
        """Its width when shown (a hidden widget's own width says nothing: a splitter may
        have squeezed it, and then it looked as if showing it cost no room)."""
        if self.sidebar.isVisible():
            self._shown_sidebar_width = self.sidebar.width()
        return getattr(self, "_shown_sidebar_width", None) or self.sidebar.sizeHint().width()

    def _fit_sidebar(self) -> None:
        bar = self.sidebar
        if bar is None:
            return
        need = self._pane_count() * PANE_ROOM
        room = self.window.width() - self._docked_width() - self._sidebar_width()
        if bar.isVisible() and not self.sidebar_pinned and room < need:
            self.sidebar_auto_hidden = True
            self.window.toggle_sidebar(False, by_user=False)
            self.window.statusBar().showMessage(SIDEBAR_HINT, 8000)
        elif self.sidebar_auto_hidden and room >= need:
            self.sidebar_auto_hidden = False
            self.window.toggle_sidebar(True, by_user=False)
            if self.window.statusBar().currentMessage() == SIDEBAR_HINT:
                self.window.statusBar().clearMessage()

    # ---- the monitor's width -------------------------------------------------------------

    def _crowded(self) -> bool:
        """Whether the panes get less than PANE_ROOM each beside the monitor's own width."""
        sidebar = self._sidebar_width() if self.sidebar is not None and \
            self.sidebar.isVisible() else 0
        return self.window.width() - self._natural_width() - sidebar < \
            self._pane_count() * PANE_ROOM

    def _cap_width(self, crowded: bool | None = None) -> int:
        crowded = self._crowded() if crowded is None else crowded
        share = CROWDED_SHARE if crowded else MAX_SHARE
        return max(self.dock.minimumSizeHint().width(), int(self.window.width() * share))

    def _remember_width(self) -> None:
        if self.preferred_width is None:
            self.preferred_width = self.dock.width()

    def _cap(self) -> None:
        dock = self.dock
        if dock.isFloating() or not dock.isVisible():
            return
        if self.window.dockWidgetArea(dock) != Qt.DockWidgetArea.RightDockWidgetArea:
            return
        cap = self._cap_width()
        want = None
        if dock.width() > cap:
            self._remember_width()
            want = cap
        elif self.preferred_width is not None and dock.width() < min(cap, self.preferred_width):
            want = min(cap, self.preferred_width)  # room again: back towards its own width
        if want is not None and want != dock.width():
            self._expected = want  # applied at the next layout pass, not by the user
            self.window.resizeDocks([dock], [want], Qt.Orientation.Horizontal)
