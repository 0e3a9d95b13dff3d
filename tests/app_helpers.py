"""Helpers for the app tests: build a real main window on the shared real engine."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.bridges.engine_bridge import EngineBridge
from app.core.app_settings import AppSettings
from app.core.records import ChatSettings, Status
from app.core.store import Store
from app.window.main_window import MainWindow
from engine import SamplingParams

WAIT_MS = int(os.environ.get("PAGEDCHAT_TEST_WAIT_MS", "240000"))  # CI machines are slow


@dataclass
class Harness:
    store: Store
    bridge: EngineBridge
    window: MainWindow

    def close(self) -> None:
        self.window.shutdown_chats()
        self.window.close()
        self.bridge.shutdown()  # stops polling; never stops an engine it does not own
        self.store.close()


@contextlib.contextmanager
def engineless_window(qtbot: Any, store: Store,
                      size: tuple[int, int] | None = None) -> Iterator[MainWindow]:
    """A real main window on ``store`` with no engine behind it (for tests that need no
    model); on exit its chats are shut down and the store closed."""
    w = MainWindow(store, EngineBridge())
    qtbot.addWidget(w)
    if size is not None:
        w.resize(*size)
    w.show()
    qtbot.waitExposed(w)
    try:
        yield w
    finally:
        w.shutdown_chats()
        store.close()


def open_window(qtbot: Any, data_dir: Any, engine: Any) -> Harness:
    store = Store(data_dir)
    bridge = EngineBridge(engine=engine)
    window = MainWindow(store, bridge, AppSettings.load(store))
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: bridge.status == "ready", timeout=WAIT_MS)
    return Harness(store, bridge, window)


def greedy(max_tokens: int = 16, system: str = "") -> ChatSettings:
    return ChatSettings(
        system_prompt=system, sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )


def last_reply(pane: Any) -> Any:
    return pane.session.active_path()[-1]


def wait_idle(qtbot: Any, *panes: Any) -> None:
    qtbot.waitUntil(lambda: not any(p.session.busy for p in panes), timeout=WAIT_MS)


def finished(msg: Any) -> bool:
    return msg.status not in Status.LIVE
