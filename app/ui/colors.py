"""Accent colours for chats: one fixed palette shared by the panes and the KV monitor.

Every chat owns an index into PALETTE (persisted with the conversation, handed out round
robin so side-by-side chats differ). `accent_color(session_id)` is the single lookup both the
chat panes and the monitor use, so a chat's pane border and its blocks in the pool map always
share a colour. Chats never registered (e.g. sessions started by other tools) still get a
stable colour from a hash of their id.
"""

from __future__ import annotations

import zlib

from PySide6.QtGui import QColor

# Mid-tone colours that read on both light and dark backgrounds (macOS system hues).
PALETTE: tuple[str, ...] = (
    "#0A7CFF",  # blue
    "#F28C28",  # orange
    "#2DB55D",  # green
    "#A259D9",  # purple
    "#E8457C",  # pink
    "#1FA7B8",  # teal
    "#5B5BD6",  # indigo
    "#A2845E",  # brown
)

# The API server's sessions ("API", "API · user": app/server/routes.py's SESSION_PREFIX) have
# a colour no chat gets (it hashed into the chats' palette, so a request looked like a chat).
API_PREFIX = "API"
API_COLOR = "#B8A200"  # olive gold: between the palette's orange and green, unlike both

_assigned: dict[str, int] = {}


def register(session_id: str, index: int) -> None:
    """Fix the palette index of a chat (called when a conversation is loaded or created)."""
    _assigned[session_id] = index % len(PALETTE)


def forget(session_id: str) -> None:
    """Drop a deleted chat's colour."""
    _assigned.pop(session_id, None)


def forget_all() -> None:
    """Forget every assignment (what a fresh process starts with; used by relaunch tests)."""
    _assigned.clear()


def color_index(session_id: str) -> int:
    """The palette index of a chat: its registered one, else a stable hash of its id."""
    if session_id in _assigned:
        return _assigned[session_id]
    return zlib.crc32(session_id.encode("utf-8")) % len(PALETTE)


def is_api_session(session_id: str) -> bool:
    return session_id == API_PREFIX or session_id.startswith(f"{API_PREFIX} · ")


def accent_color(session_id: str) -> QColor:
    """The accent colour of a chat (a new QColor each call, safe to modify); the API server's
    sessions share one of their own."""
    if is_api_session(session_id) and session_id not in _assigned:
        return QColor(API_COLOR)
    return QColor(PALETTE[color_index(session_id)])
