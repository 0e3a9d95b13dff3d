"""One shared timer that paces the re-rendering of streaming replies for all panes.

Tokens only append text and mark their message model dirty; the text is re-rendered when this
timer fires, at most `MAX_HZ` times a second for all panes together (docs/FACTS.md: apps that
re-render markdown per token get slow). The timer runs only while something is dirty.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

from PySide6.QtCore import QObject, QTimer

MAX_HZ = 30


class Flushable(Protocol):
    def flush_render(self) -> None: ...


class RenderThrottle(QObject):
    def __init__(self, parent: QObject | None = None, hz: int = MAX_HZ) -> None:
        super().__init__(parent)
        self._dirty: dict[int, Flushable] = {}
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(max(1, round(1000 / hz)))
        self._timer.timeout.connect(self._tick)
        self.ticks = 0  # how many times the timer flushed (tests, benchmarks)

    def mark_dirty(self, client: Flushable) -> None:
        self._dirty[id(client)] = client
        if not self._timer.isActive():
            self._timer.start()

    def discard(self, client: Flushable) -> None:
        self._dirty.pop(id(client), None)

    def _tick(self) -> None:
        self.ticks += 1
        clients, self._dirty = list(self._dirty.values()), {}
        for c in clients:
            with contextlib.suppress(RuntimeError):  # its view was deleted meanwhile
                c.flush_render()


_shared: RenderThrottle | None = None


def shared_throttle() -> RenderThrottle:
    """The process-wide throttle (created on first use, owned by the QApplication)."""
    global _shared
    if _shared is None:
        from PySide6.QtWidgets import QApplication

        _shared = RenderThrottle(QApplication.instance())
    return _shared
