"""Remote chats' requests -> Qt signals, with the same shape as the EngineBridge's.

Each request is an asyncio task on the qasync loop running the Qt-free streaming client
(app.core.providers.client); its TokenEvents and FinalEvents are re-emitted as
`tokenReceived` / `finalReceived` carrying the chat's session id and the request id, exactly
as the engine bridge does, so the SessionManager routes both the same way and a ChatSession
does not care where its reply comes from. Cancelling a request cancels its task, which closes
the HTTP stream. The GUI thread never waits on the network: everything here is awaited.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.core.providers import ProviderRegistry
from app.core.providers.client import stream_chat
from engine import FinalEvent, SamplingParams, TokenEvent

RATE_WINDOW_S = 2.0  # tokens/s over the last 2 s, as the engine's telemetry does


@dataclass(frozen=True)
class RemoteStats:
    """A remote chat's row in the KV monitor's chat table: no blocks, its stream's rate.
    The field names are the engine's SessionStats' (the table reads those)."""

    state: str = "remote"
    blocks_held: int = 0
    blocks_shared: int = 0
    tokens_in_context: int = 0
    wasted_slots: int = 0
    tokens_per_s: float = 0.0
    requests: int = 0


class RemoteBridge(QObject):
    tokenReceived = Signal(str, str, int, str)  # session_id, request_id, index, text delta
    finalReceived = Signal(str, str, int, object)  # session_id, request_id, index, FinalEvent
    activityChanged = Signal(str)  # session id: a remote request started or ended

    def __init__(self, registry: ProviderRegistry, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.registry = registry
        self._tasks: dict[str, asyncio.Task] = {}  # request_id -> task
        self._sessions: dict[str, str] = {}  # request_id -> session_id
        self._stamps: dict[str, list[float]] = {}  # session_id -> recent token times

    def submit(self, model_ref: str, messages: list[dict[str, str]], params: SamplingParams,
               session_id: str) -> str:
        """Start streaming a reply from the provider `model_ref` names; returns the request
        id at once. Raises ValueError (a message for the user) when that provider is gone."""
        found = self.registry.resolve(model_ref)
        if found is None:
            raise ValueError("This chat's provider was removed: pick another model in the"
                             " pane's header.")
        if not messages:
            raise ValueError("Nothing to send.")
        provider, model = found
        key = self.registry.key(provider)
        request_id = "remote-" + uuid.uuid4().hex[:12]
        task = asyncio.ensure_future(stream_chat(
            provider, key, model, messages, params, session_id, request_id, self._emit))
        self._tasks[request_id] = task
        self._sessions[request_id] = session_id
        task.add_done_callback(lambda _t, rid=request_id: self._done(rid))
        self.activityChanged.emit(session_id)
        return request_id

    def _emit(self, event: Any) -> None:
        if isinstance(event, TokenEvent):
            stamps = self._stamps.setdefault(event.session_id, [])
            stamps.append(time.monotonic())
            self.tokenReceived.emit(event.session_id, event.request_id, event.index, event.text)
        elif isinstance(event, FinalEvent):
            self.finalReceived.emit(event.session_id, event.request_id, event.index, event)

    def _done(self, request_id: str) -> None:
        self._tasks.pop(request_id, None)
        sid = self._sessions.pop(request_id, None)
        if sid is not None:
            self.activityChanged.emit(sid)

    def cancel(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def cancel_session(self, session_id: str) -> None:
        for rid in self.active_requests(session_id):
            self.cancel(rid)

    def active_requests(self, session_id: str | None = None) -> list[str]:
        return [r for r, s in self._sessions.items() if session_id is None or s == session_id]

    def owns(self, request_id: str) -> bool:
        return request_id in self._tasks

    def tokens_per_s(self, session_id: str) -> float:
        """Text pieces per second streamed for the chat over the last RATE_WINDOW_S."""
        stamps = self._stamps.get(session_id)
        if not stamps:
            return 0.0
        now = time.monotonic()
        while stamps and now - stamps[0] > RATE_WINDOW_S:
            stamps.pop(0)
        return len(stamps) / RATE_WINDOW_S

    def stats(self, session_ids: Any) -> dict[str, RemoteStats]:
        """Monitor rows for the given remote chats."""
        out = {}
        for sid in session_ids:
            n = len(self.active_requests(sid))
            out[sid] = RemoteStats(tokens_per_s=self.tokens_per_s(sid), requests=n)
        return out
