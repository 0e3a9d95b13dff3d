"""Where each open chat's context is, for the sidebar; putting a chat to sleep; forgetting a
deleted chat's blocks (the disk tier, docs/ARCHITECTURE.md §3.14).

Every few seconds, and after a reply ends, the open local chats' conversations are turned
into tokens and looked up (``Engine.context_residency``: hashing and index lookups) in a
worker thread, since tokenising a long chat takes milliseconds the GUI thread must not
spend; the sidebar shows the answer under each title: "in memory", "asleep on disk" or
"needs reading again". A chat's context menu can keep it warm (``Engine.pin_context``: its
blocks are evicted last, re-pinned at each look as the chat grows) or put it to sleep (its
blocks leave the pool, written to disk first); deleting a chat deletes its blocks that no
other open chat shares. Chats that are not open show nothing: their messages are in the
database, not in memory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from PySide6.QtCore import QObject, QTimer

from app.core.session_logic import prompt_messages
from app.core.tree import MessageTree

logger = logging.getLogger(__name__)

#: How often the sidebar's context states are refreshed (they change when chats run, are
#: evicted or written to disk; a reply's end refreshes at once).
REFRESH_MS = 3000


def conversation_tokens(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    """The tokens a chat's blocks were computed for: its conversation so far, without the
    generation prompt (the next turn's prompt starts with exactly these)."""
    return engine.encode_chat(messages, add_generation_prompt=False)


class ContextWatch(QObject):
    def __init__(self, window: Any) -> None:
        super().__init__(window)
        self.window = window
        self._task: asyncio.Future | None = None
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        window.manager.busyChanged.connect(lambda _sid, busy: None if busy else self.refresh())
        window.bridge.snapshotUpdated.connect(self.tell_disk_error)
        self.told = ""  # the disk tier's error the user was told about (once)

    def tell_disk_error(self, snapshot: Any) -> None:
        """The disk tier's first error (a full disk, a folder that cannot be written), told
        once in the status bar; chats go on (recomputed), the monitor keeps a ⚠ on it."""
        disk = getattr(snapshot, "disk", None)
        error = getattr(disk, "error", "") if disk is not None else ""
        if error and error != self.told:
            self.told = error
            self.window.statusBar().showMessage(error, 30_000)

    def _engine(self) -> Any:
        """The running engine, if it answers for contexts (None otherwise)."""
        bridge = self.window.bridge
        engine = bridge.engine
        ready = engine is not None and bridge.status == "ready"
        return engine if ready and hasattr(engine, "context_residency") else None

    def _conversations(self, exclude: str = "") -> dict[str, list[dict[str, str]]]:
        """The open local chats with messages: id -> what the engine saw of them."""
        out = {}
        for sid, session in self.window.manager.sessions.items():
            if (sid == exclude or session.is_remote or session.incognito
                    or not session.tree.by_id):
                continue
            out[sid] = session.prompt_messages(session.tree.active_leaf)
        return out

    def refresh(self) -> None:
        """Look every open chat up again, in a worker thread (one look at a time)."""
        engine = self._engine()
        if engine is None or (self._task is not None and not self._task.done()):
            return
        chats = self._conversations()
        if not chats:
            return

        pinned = set(self.window.sidebar.model.pinned)
        # A chat answering now holds its blocks; its conversation so far (a partial reply
        # the template closes) is not what the engine computed, so it is not looked up.
        answering = set(self.window.manager.busy_sessions())

        def look() -> dict[str, str]:
            states = {sid: "memory" for sid in chats if sid in answering}
            for sid, messages in chats.items():
                if sid in answering:
                    continue
                tokens = conversation_tokens(engine, messages)
                if sid in pinned:  # the pin follows the chat as it grows
                    engine.pin_context(sid, tokens)
                states[sid] = engine.context_residency(tokens).state
            return states

        self._task = asyncio.ensure_future(self._show(asyncio.to_thread(look)))

    async def _show(self, looking: Any) -> None:
        try:
            states = await looking
        except Exception:  # the engine stopped, a chat was emptied: the next look retries
            logger.debug("context look failed", exc_info=True)
            return
        model = self.window.sidebar.model
        for sid, state in states.items():
            model.set_context(sid, state)

    def keep_warm(self, conversation_id: str, on: bool) -> None:
        """Keep a chat's context in memory (its blocks are evicted last), or no more."""
        self.window.sidebar.model.set_pinned(conversation_id, on)
        engine = self._engine()
        if engine is None:
            return
        if on:
            self.refresh()  # pins it with its current tokens
        else:
            engine.pin_context(conversation_id, None)

    def sleep(self, conversation_id: str) -> None:
        """Put a chat to sleep: its blocks leave the pool (written to disk first); a chat
        kept warm is let go first."""
        if conversation_id in self.window.sidebar.model.pinned:
            self.keep_warm(conversation_id, False)
        engine = self._engine()
        messages = self._conversations().get(conversation_id)
        if engine is None or messages is None:
            return
        asyncio.ensure_future(self._sleep(engine, conversation_id, messages))

    async def _sleep(self, engine: Any, conversation_id: str,
                     messages: list[dict[str, str]]) -> None:
        try:
            tokens = await asyncio.to_thread(conversation_tokens, engine, messages)
            engine.sleep_context(tokens)
        except Exception:  # the engine stopped meanwhile: nothing to free
            logger.debug("sleep failed", exc_info=True)
            return
        self.window.sidebar.model.set_context(conversation_id, "disk")

    def _stored_messages(self, conversation_id: str) -> list[dict[str, str]] | None:
        """What the engine saw of a chat that is not open: read from the store (None for a
        remote chat, an empty or unknown one)."""
        store = self.window.store
        conv = store.get_conversation(conversation_id)
        if conv is None or conv.model or conv.active_leaf is None:
            return None
        tree = MessageTree(store.load_messages(conversation_id), conv.active_leaf)
        return prompt_messages(conv.settings.system_prompt, tree.path_to(conv.active_leaf))

    def forget(self, conversation_id: str) -> None:
        """A chat is being deleted: its blocks that no other open chat shares go, from the
        pool and the disk (call before the chat is deleted from the store)."""
        engine = self._engine()
        messages = self._conversations().get(conversation_id)
        if messages is None and conversation_id not in self.window.manager.sessions:
            messages = self._stored_messages(conversation_id)
        if engine is None or messages is None:
            return
        others = list(self._conversations(exclude=conversation_id).values())

        def tokens() -> tuple[list[int], list[list[int]]]:
            return (conversation_tokens(engine, messages),
                    [conversation_tokens(engine, m) for m in others])

        async def run() -> None:
            try:
                mine, keep = await asyncio.to_thread(tokens)
                engine.forget_context(mine, keep=keep)
            except Exception:  # the engine stopped meanwhile: its cache stays (LRU)
                logger.debug("forget failed", exc_info=True)
                return

        asyncio.ensure_future(run())
