"""Writes that never stall the caller and never lose data while the disk misbehaves.

A write is first tried at once on the caller's connection (a few hundred microseconds), with
no busy wait at all: if another program holds the write lock the attempt fails at once rather
than sleeping on the GUI thread (the retry thread is the only other writer of this process,
and it never writes while the caller does). If it fails for a reason that can pass (database
locked, disk full, read-only folder, I/O error), it and every later write join an in-memory
backlog, in order, and a retry thread with its own connection replays the backlog until it
succeeds. Listeners hear when saving stops working and when it works again (from the retry
thread: a Qt listener must re-emit through a signal). Errors that retrying cannot fix (a
constraint broken by a bug) are raised to the caller as before.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.db_recovery import describe_error

log = logging.getLogger(__name__)

FIRST_TRY_BUSY_MS = 0  # the caller never sleeps on another program's lock
RETRY_BUSY_MS = 1000  # the retry thread may wait longer: nobody waits on it
RETRY_DELAYS_S = (0.1, 0.25, 0.5, 1.0, 2.0)  # back-off between retries of the backlog

Op = tuple[str, Sequence[Any]]


@dataclass(frozen=True)
class SaveState:
    """Whether saving works; `problem` is a short cause ("disk full") while it does not."""

    problem: str | None
    pending: int

    @property
    def ok(self) -> bool:
        return self.problem is None


def transient_cause(exc: BaseException) -> str | None:
    """A user-facing cause when retrying the write later may succeed, else None."""
    if isinstance(exc, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.InterfaceError):
        return None
    if not isinstance(exc, sqlite3.DatabaseError):
        return None
    return describe_error(exc) or f"SQLite error: {exc}"


def run_ops(db: sqlite3.Connection, ops: Sequence[Op]) -> int:
    """Run `ops` as one transaction on an autocommit connection; the last statement's rowcount."""
    if len(ops) == 1:
        return db.execute(*ops[0]).rowcount
    db.execute("BEGIN IMMEDIATE")
    try:
        count = 0
        for sql, args in ops:
            count = db.execute(sql, args).rowcount
        db.execute("COMMIT")
        return count
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


class WriteBehind:
    def __init__(
        self,
        path: Path,
        db: sqlite3.Connection,
        configure: Callable[[sqlite3.Connection], None],
    ) -> None:
        self.path = path
        self._db = db
        self._configure = configure
        self._backlog: deque[Sequence[Op]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._running = False  # a retry thread owns the backlog (changed under _lock only)
        self._problem: str | None = None
        self._listeners: list[Callable[[SaveState], None]] = []
        db.execute(f"PRAGMA busy_timeout={FIRST_TRY_BUSY_MS}")

    # ---- public --------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[SaveState], None]) -> None:
        self._listeners.append(listener)

    @property
    def state(self) -> SaveState:
        with self._lock:
            return SaveState(self._problem, len(self._backlog))

    def write(self, ops: Sequence[Op]) -> None:
        """Apply `ops` (one transaction) now, or queue them behind earlier failed writes."""
        with self._lock:
            if self._backlog:
                self._backlog.append(ops)
                return
        try:
            run_ops(self._db, ops)
        except sqlite3.Error as exc:
            cause = transient_cause(exc)
            if cause is None:
                raise
            log.info("write deferred (%s): %s", cause, exc)
            with self._lock:
                self._backlog.append(ops)
                self._problem = cause
                state = SaveState(cause, len(self._backlog))
                thread = None
                if not self._running:
                    self._running = True
                    thread = threading.Thread(target=self._retry_loop, name="db-retry", daemon=True)
                    self._thread = thread
            if thread is not None:
                thread.start()
            self._notify(state)

    def retry_now(self) -> None:
        """Wake the retry thread (the user asked, or something suggests the fault passed)."""
        self._wake.set()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the backlog to be written; True if nothing is pending."""
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.state.pending

    def close(self, timeout: float = 3.0) -> int:
        """Try to write what is pending, stop retrying; returns the writes left unsaved."""
        self.flush(timeout)
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.state.pending

    def pending_ops(self) -> list[Sequence[Op]]:
        with self._lock:
            return list(self._backlog)

    # ---- the retry thread ----------------------------------------------------------------

    def _notify(self, state: SaveState) -> None:
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:  # a broken listener must not stop saving
                log.exception("save-state listener failed")

    def _retry_loop(self) -> None:
        db: sqlite3.Connection | None = None
        attempt = 0
        try:
            while not self._closing:
                delay = RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]
                self._wake.wait(delay)
                self._wake.clear()
                try:
                    if db is None:
                        db = sqlite3.connect(str(self.path), isolation_level=None)
                        self._configure(db)
                        db.execute(f"PRAGMA busy_timeout={RETRY_BUSY_MS}")
                    if self._drain(db):
                        return
                    attempt = 0  # progress
                except sqlite3.Error as exc:
                    cause = transient_cause(exc) or f"SQLite error: {exc}"
                    attempt += 1
                    with self._lock:
                        changed = cause != self._problem
                        self._problem = cause
                        state = SaveState(cause, len(self._backlog))
                    if changed:
                        self._notify(state)
        finally:
            if db is not None:
                db.close()
            with self._lock:
                if self._thread is threading.current_thread():
                    self._running = False

    def _drain(self, db: sqlite3.Connection) -> bool:
        """Write the backlog in order; True once it is empty (saving works again)."""
        while True:
            with self._lock:
                if not self._backlog:
                    self._problem = None
                    self._running = False  # a later failure starts a new thread
                    state = SaveState(None, 0)
                    break
                ops = self._backlog[0]
            try:
                run_ops(db, ops)
            except sqlite3.Error as exc:
                if transient_cause(exc) is not None:
                    raise
                log.error("dropped a write that cannot succeed: %s", exc)
            with self._lock:
                self._backlog.popleft()
        self._notify(state)
        return True
