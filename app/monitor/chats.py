"""What the monitor needs to know about the app's chats: titles, colours, focus, hover.

The engine only knows session ids. Whoever shows the chats (the main window) hands the
monitor an object of the `Chats` protocol; the monitor asks it and never looks for the
window itself. Without one (tests, tools) `NoChats` stands in: titles fall back to session
ids, colours to the shared palette, and focusing does nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QColor

from app.ui import colors


class Chats(Protocol):
    """The app's chats as the monitor sees them."""

    @property
    def chatHovered(self) -> Any:  # noqa: N802 - a Qt signal: emits a session id or None
        """Emitted with the session id of the chat under the pointer, None when it leaves."""

    def chat_title(self, session_id: str) -> str | None:
        """The chat's title, None when the app does not know the session."""

    def chat_color(self, session_id: str) -> QColor:
        """The chat's accent colour (its pane's, its blocks')."""

    def focus_chat(self, session_id: str) -> bool:
        """Focus the pane showing this chat; False when it is not open in a pane."""

    def remote_sessions(self) -> dict[str, Any]:
        """Rows for chats talking to a remote provider (state "remote", no blocks), by
        session id; their fields are SessionStats'. Optional: absent means none."""

    def queued_sessions(self) -> dict[str, float]:
        """Chats that asked the engine for a reply, by session id, with the time.time() of
        the request: shown "waiting" until a snapshot newer than it has them. Optional."""


class NoChats(QObject):
    """The Chats of a monitor shown without the app (never hovers, never focuses)."""

    chatHovered = Signal(object)

    def chat_title(self, session_id: str) -> str | None:
        return None

    def chat_color(self, session_id: str) -> QColor:
        return colors.accent_color(session_id)

    def focus_chat(self, session_id: str) -> bool:
        return False
