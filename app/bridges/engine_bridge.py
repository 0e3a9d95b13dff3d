"""The one place the app touches the engine: engine events -> Qt signals, on the GUI thread.

The engine runs on its own thread. Requests are submitted through its thread-safe inbox
(`Engine.submit` never blocks), and each request's events are consumed by an asyncio task on
the qasync loop (`handle.stream()`), then re-emitted as Qt signals that always carry the chat's
session id and the request id, so output can never land in the wrong chat. Anything that may
block (waiting for the model, stopping the engine thread, counting tokens) runs in a worker
thread through `asyncio.to_thread`; the GUI thread never waits on the engine.

A QTimer polls `Engine.snapshot()` at 10 Hz; the chat footers and the KV monitor consume the
same immutable snapshots through `snapshotUpdated` / `latest_snapshot`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from engine import (
    Engine,
    EngineConfig,
    EngineStatus,
    FinalEvent,
    FinishReason,
    Priority,
    SamplingParams,
    TokenEvent,
)

log = logging.getLogger(__name__)

IDLE = "idle"  # the bridge's status before any engine was started; then an EngineStatus
SNAPSHOT_INTERVAL_MS = 100  # 10 Hz is plenty for footers and the monitor (docs §3.8)


class EngineBridge(QObject):
    """Owns (or wraps) one Engine and turns its events into Qt signals.

    Pass `engine` to wrap an engine someone else started (tests share one per module); the
    bridge then never stops it. Otherwise `start(config)` creates and owns one, and
    `restart(config)` swaps it for a new one (changing model, KV budget or block size).
    """

    statusChanged = Signal(str)  # IDLE or an EngineStatus
    modelReady = Signal(object)  # engine.model_info
    loadFailed = Signal(str)  # one human-readable message
    tokenReceived = Signal(str, str, int, str)  # session_id, request_id, index, text delta
    finalReceived = Signal(str, str, int, object)  # session_id, request_id, index, FinalEvent
    snapshotUpdated = Signal(object)  # PoolSnapshot

    def __init__(self, engine: Engine | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._engine: Engine | None = engine
        self._owns_engine = engine is None
        self._status = IDLE
        self._load_error: str | None = None
        self._model_info: Any = None
        self._config: EngineConfig | None = (
            engine.config if engine is not None and hasattr(engine, "config") else None
        )
        self._handles: dict[str, Any] = {}  # request_id -> RequestHandle
        self._sessions: dict[str, str] = {}  # request_id -> session_id
        # The chat in front of the user (docs/ARCHITECTURE.md §3.3): it goes first, the others
        # yield; the priority last given to each chat with a live request.
        self._focused: str | None = None
        self._priority: dict[str, Priority] = {}
        self._tasks: set[asyncio.Task] = set()
        self._latest_snapshot: Any = None
        self._timer = QTimer(self)
        self._timer.setInterval(SNAPSHOT_INTERVAL_MS)
        self._timer.timeout.connect(self._poll)
        if engine is not None:
            self._watch(engine)

    # ---- state ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine | None:
        return self._engine

    @property
    def status(self) -> str:
        return self._status

    @property
    def load_error(self) -> str | None:
        return self._load_error

    @property
    def model_info(self) -> Any:
        return self._model_info

    @property
    def config(self) -> EngineConfig | None:
        return self._config

    @property
    def latest_snapshot(self) -> Any:
        """The last PoolSnapshot polled (None before the model is ready)."""
        return self._latest_snapshot

    @property
    def max_context(self) -> int | None:
        info = self._model_info
        return getattr(info, "max_context", None) if info is not None else None

    def active_requests(self, session_id: str | None = None) -> list[str]:
        return [r for r, s in self._sessions.items() if session_id is None or s == session_id]

    def _set_status(self, status: str) -> None:
        if status != self._status:
            self._status = status
            self.statusChanged.emit(status)

    # ---- life cycle ----------------------------------------------------------------------

    def start(self, config: EngineConfig) -> None:
        """Create and start an engine; returns at once (the model loads on the engine thread)."""
        if self._engine is not None:
            raise RuntimeError("engine already started; use restart()")
        self._config = config
        self._owns_engine = True
        try:
            engine = Engine(config)
            engine.start()
        except Exception as exc:  # a bad config must show as a message, not a crash
            self._engine = None
            self._fail(str(exc) or type(exc).__name__)
            return
        self._engine = engine
        self._watch(engine)

    async def restart(self, config: EngineConfig) -> None:
        """Stop the current engine (cancelling its requests) and start one with `config`."""
        old = self._engine
        self._cancel_all()
        self._engine = None
        self._model_info = None
        self._latest_snapshot = None
        self._timer.stop()
        if old is not None and self._owns_engine:
            self._set_status(EngineStatus.LOADING)
            await asyncio.to_thread(old.stop)
        self._load_error = None
        self.start(config)

    def _watch(self, engine: Engine) -> None:
        self._load_error = None
        self._set_status(EngineStatus.LOADING)
        self._spawn(self._wait_ready(engine))

    async def _wait_ready(self, engine: Engine) -> None:
        while True:
            ready = await asyncio.to_thread(engine.wait_ready, 0.25)
            if engine is not self._engine:
                return  # replaced meanwhile
            if ready or engine.status == EngineStatus.READY:
                break
            if engine.status in (EngineStatus.ERROR, EngineStatus.STOPPED):
                self._fail(engine.load_error or f"The engine {engine.status} while loading.")
                return
        self._model_info = engine.model_info
        self._load_error = None
        self._set_status(EngineStatus.READY)
        self._timer.start()
        self._poll()
        self.modelReady.emit(self._model_info)

    def fail(self, message: str) -> None:
        """Report a problem found before starting (e.g. a model folder that does not exist)."""
        self._fail(message)

    def _fail(self, message: str) -> None:
        self._load_error = message
        self._set_status(EngineStatus.ERROR)
        self.loadFailed.emit(message)

    def shutdown(self) -> None:
        """Cancel everything and stop an owned engine. Blocking: only call while quitting."""
        self._timer.stop()
        self._cancel_all()
        engine, self._engine = self._engine, None
        if engine is not None and self._owns_engine:
            engine.stop()
        self._set_status(EngineStatus.STOPPED)

    async def shutdown_async(self) -> None:
        """Like shutdown(), with the engine thread joined off the GUI thread."""
        self._timer.stop()
        self._cancel_all()
        engine, self._engine = self._engine, None
        if engine is not None and self._owns_engine:
            await asyncio.to_thread(engine.stop)
        self._set_status(EngineStatus.STOPPED)

    # ---- requests ------------------------------------------------------------------------

    def submit(
        self, messages: list[dict[str, str]], params: SamplingParams, session_id: str,
        priority: Priority = Priority.INTERACTIVE, incognito: bool = False,
    ) -> str:
        """Submit a chat request; returns its request id. Never blocks. A message the user
        sends goes first (INTERACTIVE, the default); work the app does on its own (titles)
        passes BACKGROUND.

        ``incognito``: an incognito chat's request (its KV never shared, never written to
        disk, zeroed when released). Raises ValueError for a request the engine refuses
        (e.g. no messages) and RuntimeError when no model is loaded, each with a message
        fit for the user.
        """
        engine = self._engine
        if engine is None or self._status in (EngineStatus.ERROR, EngineStatus.STOPPED, IDLE):
            reason = self._load_error or "the engine is not running"
            raise RuntimeError(f"No model is loaded: {reason}")
        # The chat the user just sent in goes first, focused or not (send to all).
        handle = engine.submit(messages=messages, params=params, session_id=session_id,
                               priority=priority, incognito=incognito)
        self._priority[session_id] = priority
        self._handles[handle.request_id] = handle
        self._sessions[handle.request_id] = session_id
        self._spawn(self._pump(handle, session_id, params.n))
        return handle.request_id

    async def submit_prompt(
        self, tokens: list[int], params: SamplingParams, session_id: str,
        priority: Priority = Priority.INTERACTIVE, incognito: bool = False,
    ) -> str:
        """Submit a prompt already tokenised (a chat with tools: app/core/tool_calls.py);
        the engine's submit runs in a worker thread, since compiling a grammar of tool calls
        takes a moment. Raises like ``submit``."""
        engine = self._engine
        if engine is None or self._status in (EngineStatus.ERROR, EngineStatus.STOPPED, IDLE):
            reason = self._load_error or "the engine is not running"
            raise RuntimeError(f"No model is loaded: {reason}")
        handle = await asyncio.to_thread(
            lambda: engine.submit(prompt_tokens=tokens, params=params, session_id=session_id,
                                  priority=priority, incognito=incognito))
        self._priority[session_id] = priority
        self._handles[handle.request_id] = handle
        self._sessions[handle.request_id] = session_id
        self._spawn(self._pump(handle, session_id, params.n))
        return handle.request_id

    async def _pump(self, handle: Any, session_id: str, n: int) -> None:
        rid = handle.request_id
        finished: set[int] = set()
        try:
            async for event in handle.stream():
                if isinstance(event, TokenEvent):
                    self.tokenReceived.emit(event.session_id, rid, event.index, event.text)
                elif isinstance(event, FinalEvent):
                    finished.add(event.index)
                    self.finalReceived.emit(event.session_id, rid, event.index, event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke: end every open sample with an error
            log.exception("stream of %s failed", rid)
            for index in range(n):
                if index not in finished:
                    self.finalReceived.emit(
                        session_id, rid, index, _error_final(rid, session_id, index, str(exc))
                    )
        finally:
            self._handles.pop(rid, None)
            self._sessions.pop(rid, None)

    def set_focus(self, session_id: str | None) -> None:
        """The user put ``session_id`` in front (focused its pane; None: no chat): it goes
        first, and every other chat with a live request yields to it. Tells the engine only
        what changed."""
        self._focused = session_id
        live = set(self._sessions.values())
        for sid in live | {session_id} - {None}:
            want = Priority.INTERACTIVE if sid == session_id else Priority.BACKGROUND
            if self._priority.get(sid) == want:
                continue
            self._priority[sid] = want
            engine = self._engine
            if engine is not None and self._status == EngineStatus.READY:
                with contextlib.suppress(Exception):  # a stopping engine: nothing to reorder
                    engine.set_priority(sid, want)
        for sid in set(self._priority) - live - {session_id}:
            del self._priority[sid]  # bounded: only chats with live requests, and the focus

    def priority(self, session_id: str) -> Priority | None:
        """The priority this app last gave ``session_id`` (None: never, or gone)."""
        return self._priority.get(session_id)

    def cancel(self, request_id: str) -> None:
        """Cancel one request (its blocks are freed at once; samples end CANCELLED)."""
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.cancel()

    def cancel_session(self, session_id: str) -> None:
        """Cancel every request of a chat (used when it is deleted)."""
        for rid in self.active_requests(session_id):
            self.cancel(rid)
        if self._engine is not None and self._status == EngineStatus.READY:
            with contextlib.suppress(Exception):
                self._engine.cancel_session(session_id)

    def _cancel_all(self) -> None:
        for handle in list(self._handles.values()):
            with contextlib.suppress(Exception):
                handle.cancel()

    async def count_tokens(self, messages: list[dict[str, str]]) -> int | None:
        """Prompt tokens of `messages` after the chat template (None when unknown)."""
        engine = self._engine
        if engine is None or self._status != EngineStatus.READY or not messages:
            return None
        try:
            return await asyncio.to_thread(engine.count_tokens, messages)
        except Exception:
            log.debug("count_tokens failed", exc_info=True)
            return None

    # ---- snapshots -----------------------------------------------------------------------

    def _poll(self) -> None:
        engine = self._engine
        if engine is None:
            return
        status = engine.status
        stopped = status in (EngineStatus.ERROR, EngineStatus.STOPPED)
        if stopped and self._status == EngineStatus.READY:
            self._timer.stop()
            self._fail(engine.load_error or f"The engine {status}.")
            return
        try:
            snap = engine.snapshot()
        except Exception:
            log.debug("snapshot failed", exc_info=True)
            return
        if snap is None:
            return  # not built yet
        self._latest_snapshot = snap
        self.snapshotUpdated.emit(snap)

    # ---- helpers -------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@dataclass(frozen=True)
class StreamFailure:
    """Stands in for a FinalEvent when a stream breaks (same fields the app reads)."""

    request_id: str
    session_id: str
    index: int
    finish_reason: FinishReason
    text: str
    usage: Any
    error: str | None


def _error_final(request_id: str, session_id: str, index: int, message: str) -> StreamFailure:
    return StreamFailure(request_id, session_id, index, FinishReason.ERROR, "", None, message)
