"""What the monitor needs to know about the app's chats: titles, pane focus, pane hover.

The engine only knows session ids. The main window knows the chats (`all_sessions()`), their
panes (`pane_for(id)`, `panes`, `focus_pane(i)`); this adapter reads those public members
without the window having to know about the monitor, and watches pane hover with an event
filter (Enter / Leave), so no chat code changes. Without a window (tests, tools) titles fall
back to session ids and focusing does nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

from PySide6.QtCore import QEvent, QObject, Signal


class ChatDirectory(QObject):
    paneHovered = Signal(object)  # session id of the hovered pane, or None on leave

    def __init__(self, window: Any = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._window = window
        self._watched: weakref.WeakSet[QObject] = weakref.WeakSet()
        self._hovered: str | None = None

    @property
    def window(self) -> Any:
        return self._window

    def title(self, session_id: str) -> str:
        """The chat's title, or its session id when the app does not know the session."""
        sessions = self._sessions()
        session = sessions.get(session_id)
        title = getattr(session, "title", None)
        return str(title) if title else session_id

    def _sessions(self) -> dict[str, Any]:
        w = self._window
        if w is None or not hasattr(w, "all_sessions"):
            return {}
        try:
            return dict(w.all_sessions())
        except Exception:
            return {}

    def focus(self, session_id: str) -> bool:
        """Focus the pane showing this chat; False when it is not open in a pane."""
        w = self._window
        pane = w.pane_for(session_id) if w is not None and hasattr(w, "pane_for") else None
        if pane is None:
            return False
        panes = list(getattr(w, "panes", []))
        if pane in panes and hasattr(w, "focus_pane"):
            w.focus_pane(panes.index(pane))
        else:
            pane.setFocus()
        return True

    def watch_panes(self) -> None:
        """Install the hover filter on panes opened since the last call (cheap to repeat)."""
        w = self._window
        for pane in list(getattr(w, "panes", []) if w is not None else []):
            if pane not in self._watched:
                pane.installEventFilter(self)
                self._watched.add(pane)

    @property
    def hovered(self) -> str | None:
        return self._hovered

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        kind = event.type()
        if kind == QEvent.Type.Enter:
            session = getattr(obj, "session", None)
            sid = getattr(session, "id", None)
            if sid != self._hovered:
                self._hovered = sid
                self.paneHovered.emit(sid)
        elif kind == QEvent.Type.Leave and self._hovered is not None:
            self._hovered = None
            self.paneHovered.emit(None)
        return False
