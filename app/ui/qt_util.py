"""Small Qt helpers used across the app."""

from __future__ import annotations

import contextlib
from typing import Any

from PySide6.QtCore import QByteArray


def disconnect(signal: Any, slot: Any) -> None:
    """Disconnect a slot if connected; a no-op when it is not (or the object is gone)."""
    with contextlib.suppress(RuntimeError, TypeError):
        signal.disconnect(slot)


def to_b64(data: QByteArray) -> str:
    """Saved Qt state (geometry, splitter sizes) as text for the JSON layout."""
    return bytes(data.toBase64().data()).decode("ascii")


def from_b64(text: Any) -> QByteArray:
    """The Qt state `to_b64` wrote; an empty one for anything else (nothing is restored)."""
    if not isinstance(text, str):
        return QByteArray()
    return QByteArray.fromBase64(text.encode("ascii"))
