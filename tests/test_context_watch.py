"""The sidebar's context states (app/window/context_watch.py) while a chat answers.

Mid-reply, a chat's conversation so far ends in a partial reply that the chat template
closes: tokens the engine never computed, so looking them up says "needs reading again" for
a chat that is streaming (seen in the demo's screenshot). The answering chat holds its
blocks: it shows "in memory" and is not looked up; an idle chat beside it is. The window's
parts are small stand-ins; the watch, its worker-thread look and the sidebar model's
answer are the real ones.
"""

from __future__ import annotations

from types import SimpleNamespace

from PySide6.QtCore import QObject, Signal

from app.window.context_watch import ContextWatch
from engine import ContextResidency


class Signals(QObject):
    busyChanged = Signal(str, bool)
    snapshotUpdated = Signal(object)


class LookingEngine:
    """Answers for contexts as an engine whose pool holds nothing, and records each look."""

    def __init__(self) -> None:
        self.looked: list[list[int]] = []

    def encode_chat(self, messages, add_generation_prompt=True):
        return [len(m["content"]) for m in messages]

    def context_residency(self, tokens):
        self.looked.append(list(tokens))
        return ContextResidency(blocks=2, in_memory=0, on_disk=0)

    def pin_context(self, key, tokens) -> None:
        pass


class SidebarModel:
    def __init__(self) -> None:
        self.pinned: set[str] = set()
        self.states: dict[str, str] = {}

    def set_context(self, conversation_id: str, state: str) -> None:
        self.states[conversation_id] = state


def chat(sid: str, text: str, busy: bool) -> SimpleNamespace:
    return SimpleNamespace(
        id=sid, busy=busy, is_remote=False, incognito=False,
        tree=SimpleNamespace(by_id={"m1": object()}, active_leaf="m1"),
        prompt_messages=lambda _leaf: [{"role": "user", "content": text}])


def test_an_answering_chat_is_in_memory_and_never_looked_up(qtbot, qasync_loop) -> None:
    signals = Signals()
    engine = LookingEngine()
    sessions = {"answering": chat("answering", "tell me a story", busy=True),
                "idle": chat("idle", "hello there", busy=False)}
    manager = SimpleNamespace(
        sessions=sessions, busyChanged=signals.busyChanged,
        busy_sessions=lambda: [sid for sid, s in sessions.items() if s.busy])
    model = SidebarModel()
    window = QObject()
    window.manager = manager
    window.bridge = SimpleNamespace(engine=engine, status="ready",
                                    snapshotUpdated=signals.snapshotUpdated)
    window.sidebar = SimpleNamespace(model=model)
    watch = ContextWatch(window)
    watch.timer.stop()  # this test looks when it says so
    watch.refresh()
    qtbot.waitUntil(lambda: len(model.states) == 2, timeout=10_000)
    assert model.states == {"answering": "memory", "idle": "recompute"}
    assert engine.looked == [engine.encode_chat([{"content": "hello there"}])]
