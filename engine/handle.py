"""The caller's side of one request: its events, in order, for threads or asyncio.

The engine thread pushes events; any other thread reads them by blocking iteration, and an
asyncio loop (qasync included) reads them with ``async for`` without ever blocking: the engine
wakes the loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from engine.events import Event, FinalEvent


class RequestHandle:
    def __init__(
        self, request_id: str, session_id: str, n: int,
        cancel: Callable[[RequestHandle], None],
        on_done: Callable[[RequestHandle], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.session_id = session_id
        self.n = n
        self._cancel = cancel
        self._on_done = on_done
        self._events: deque[Event] = deque()
        self._cond = threading.Condition()
        self._finals = 0
        self._token_events = 0
        self._wakers: list[Callable[[], None]] = []
        self.finals: dict[int, FinalEvent] = {}

    # ---- engine side ------------------------------------------------------------------------

    def _push(self, event: Event) -> None:
        if isinstance(event, FinalEvent) and self._finals + 1 == self.n and self._on_done:
            # Before ``done`` can read True: whoever sees the request ended may reuse its id.
            self._on_done(self)
        with self._cond:
            self._events.append(event)
            if isinstance(event, FinalEvent):
                self._finals += 1
                self.finals[event.index] = event
            else:
                self._token_events += 1
            wakers = list(self._wakers)
            self._cond.notify_all()
        for wake in wakers:
            wake()

    # ---- caller side ------------------------------------------------------------------------

    @property
    def token_events(self) -> int:
        """Token events produced so far (read or not): a cheap progress measure."""
        return self._token_events

    @property
    def done(self) -> bool:
        """Every sample has its final event (they may not all have been read yet)."""
        return self._finals >= self.n

    def cancel(self) -> None:
        """Stop generating; the engine frees this request's blocks before its next step.

        Cancels this request only, never a later one that reuses its id."""
        if not self.done:
            self._cancel(self)

    def __iter__(self) -> Iterator[Event]:
        read_finals = 0
        while read_finals < self.n:
            with self._cond:
                while not self._events:
                    self._cond.wait()
                event = self._events.popleft()
            if isinstance(event, FinalEvent):
                read_finals += 1
            yield event

    def result(self, timeout: float | None = None) -> list[FinalEvent]:
        """Block until every sample has finished; their final events, by sample index."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._finals >= self.n, timeout):
                raise TimeoutError(f"request {self.request_id} still running after {timeout}s")
            return [self.finals[i] for i in sorted(self.finals)]

    async def stream(self) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(ready.set)

        with self._cond:
            self._wakers.append(wake)
        try:
            read_finals = 0
            while read_finals < self.n:
                with self._cond:
                    event = self._events.popleft() if self._events else None
                    if event is None:
                        ready.clear()
                if event is None:
                    await ready.wait()
                    continue
                if isinstance(event, FinalEvent):
                    read_finals += 1
                yield event
        finally:
            with self._cond:
                self._wakers.remove(wake)
