"""Small Qt helpers used across the app."""

from __future__ import annotations

import contextlib
from typing import Any


def disconnect(signal: Any, slot: Any) -> None:
    """Disconnect a slot if connected; a no-op when it is not (or the object is gone)."""
    with contextlib.suppress(RuntimeError, TypeError):
        signal.disconnect(slot)
