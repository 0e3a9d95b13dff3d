"""Chat titles written by the local model, in the background, after the first reply.

A chat starts titled by its first message, cut to one line; several chats opened with the
same question looked the same in the sidebar (issue 25). As chat apps do, once the first
reply is complete the local model is asked, at low cost, for a short title: one greedy
request of at most `MAX_TITLE_TOKENS` tokens on the engine's public API (through the bridge,
like any chat), sent when no chat has been answering for `QUIET_MS`, so it never slows a
reply the user is waiting for. Its answer replaces the title only while the title is still
the automatic one: a user's rename, before or after, always wins. A title another chat has is
numbered ("… 2"). The request runs under a session id of its own (`TITLE_SESSION_PREFIX` +
the chat's id), which the monitor shows as "Title for …" while it runs and which is forgotten
when it ends.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, QTimer

from app.core.records import Status
from app.core.session_logic import clean_title, title_prompt
from engine import EngineStatus, Priority, SamplingParams

MAX_TITLE_TOKENS = 16
QUIET_MS = 1500  # the engine has had no chat to answer for this long
TITLE_SESSION_PREFIX = "title:"
TITLE_PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TITLE_TOKENS)


class ChatTitler(QObject):
    def __init__(self, manager: Any, bridge: Any, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.manager = manager
        self.bridge = bridge
        self.waiting: list[str] = []  # chats whose first reply is done, to be titled
        self.running: dict[str, str] = {}  # request id -> chat id
        self._closed = False  # the window shut down: nothing is sent or renamed any more
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(QUIET_MS)
        self._timer.timeout.connect(self._send)
        manager.busyChanged.connect(self._busy_changed)
        bridge.finalReceived.connect(self._final)

    def close(self) -> None:
        """The window is shutting down: send nothing more, cancel the titles under way and
        ignore their answers (the store closes next; a final that arrived after it ended in
        "Cannot operate on a closed database" in the event loop)."""
        self._closed = True
        self._timer.stop()
        self.waiting.clear()
        for chat_id in list(self.running.values()):
            self.bridge.cancel_session(TITLE_SESSION_PREFIX + chat_id)
        self.running.clear()

    @staticmethod
    def chat_of(session_id: str) -> str | None:
        """The chat a title request's session id belongs to (None for any other session)."""
        if session_id.startswith(TITLE_SESSION_PREFIX):
            return session_id[len(TITLE_SESSION_PREFIX):]
        return None

    def _busy_changed(self, session_id: str, busy: bool) -> None:
        if self._closed:
            return
        if busy:
            self._timer.stop()  # a chat is answering: wait until it is quiet again
            return
        session = self.manager.sessions.get(session_id)
        known = session_id in self.waiting or session_id in self.running.values()
        if (session is not None and not session.incognito and not known
                and self._first_reply_done(session)):  # an incognito chat is never sent again
            self.waiting.append(session_id)
        if self.waiting and not self.manager.busy_sessions():
            self._timer.start()

    @staticmethod
    def _first_reply_done(session: Any) -> bool:
        path = session.active_path()
        return (len(path) == 2 and path[0].role == "user" and path[1].role == "assistant"
                and path[1].status in (Status.COMPLETE, Status.LENGTH)
                and bool(path[1].content.strip()) and session.title_is_automatic
                and not session.is_remote)

    def _send(self) -> None:
        if self._closed:
            return
        if self.manager.busy_sessions():
            return  # _busy_changed starts the timer again when they are done
        if self.bridge.status != EngineStatus.READY:
            self.waiting.clear()
            return
        while self.waiting:
            session = self.manager.sessions.get(self.waiting.pop(0))
            if session is None or not self._first_reply_done(session):
                continue
            user, reply = session.active_path()
            try:
                # A title is the app's own work: it never goes before a chat (§3.3).
                rid = self.bridge.submit(title_prompt(user.content, reply.content),
                                         TITLE_PARAMS, TITLE_SESSION_PREFIX + session.id,
                                         priority=Priority.BACKGROUND)
            except (ValueError, RuntimeError):
                continue  # no model now: the first message's title stays
            self.running[rid] = session.id

    def _final(self, session_id: str, request_id: str, _index: int, event: Any) -> None:
        chat_id = self.running.pop(request_id, None)
        if chat_id is None or self._closed:
            return
        self.bridge.cancel_session(session_id)  # the engine forgets the title's session
        session = self.manager.sessions.get(chat_id)
        title = clean_title(event.text or "") if not event.error else None
        if session is None or title is None or not session.title_is_automatic:
            return  # deleted, nothing usable, or renamed by the user meanwhile
        session.rename(self.manager.unique_title(title, chat_id), by_user=False)
