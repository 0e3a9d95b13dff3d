"""Rates and pool snapshots: what the engine thread publishes for monitors to read.

Kept apart from the step so that measuring never changes what a step does; a snapshot is
built at most every ``SNAPSHOT_INTERVAL_S`` (and when the engine goes idle), from the
allocator's cheap per-block tuples.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from engine.blocks import BlockAllocator
from engine.events import Counters, PoolSnapshot, SequenceState, SessionStats
from engine.scheduler import Scheduler
from engine.sequence import Request

SNAPSHOT_INTERVAL_S = 0.05
RATE_WINDOW_S = 2.0

#: A chat shows the most active state among its sequences.
_STATE_ORDER = (
    SequenceState.DECODING,
    SequenceState.PREFILLING,
    SequenceState.PREEMPTED,
    SequenceState.WAITING,
)


class Rate:
    """Tokens per second over a sliding window."""

    def __init__(self) -> None:
        self._events: deque[tuple[float, int]] = deque()

    def add(self, now: float, n: int) -> None:
        self._events.append((now, n))

    def per_second(self, now: float) -> float:
        while self._events and self._events[0][0] < now - RATE_WINDOW_S:
            self._events.popleft()
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 0.25)
        return sum(n for _, n in self._events) / span


class Telemetry:
    """Counts tokens and step times; builds the immutable snapshot other threads read."""

    def __init__(self) -> None:
        self.snapshot: PoolSnapshot | None = None
        self.generated = 0
        self.step_ms = 0.0
        self.sched_ms = 0.0
        self.batch = 0
        self._rate = Rate()
        self._session_rates: dict[str, Rate] = {}
        self._sessions: dict[str, None] = {}  # chats shown even while they run nothing
        self._last_snapshot = 0.0

    # ---- recording (engine thread) ----------------------------------------------------------

    def add_session(self, session_id: str) -> None:
        self._sessions[session_id] = None

    def forget_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._session_rates.pop(session_id, None)

    def token(self, session_id: str, now: float) -> None:
        self.generated += 1
        self._rate.add(now, 1)
        self._session_rates.setdefault(session_id, Rate()).add(now, 1)

    def step(self, batch: int, step_s: float, overhead_s: float) -> None:
        """One step ran ``batch`` works in ``step_s``, ``overhead_s`` of it outside the model."""
        self.batch = batch
        self.step_ms = _ema(self.step_ms, step_s * 1000)
        self.sched_ms = _ema(self.sched_ms, overhead_s * 1000)

    # ---- snapshots --------------------------------------------------------------------------

    def maybe_snapshot(
        self,
        alloc: BlockAllocator,
        scheduler: Scheduler,
        requests: Iterable[Request],
        bytes_per_block: int,
        model_name: str,
        force: bool = False,
    ) -> None:
        now = time.perf_counter()
        if not force and now - self._last_snapshot < SNAPSHOT_INTERVAL_S:
            return
        self._last_snapshot = now
        owners, refcounts, fills, cached, tokens = alloc.block_state()
        counters = Counters(
            steps=scheduler.steps,
            batch_size=self.batch if scheduler.has_work else 0,
            step_time_ms=self.step_ms,
            schedule_time_ms=self.sched_ms,
            preemptions=scheduler.preemptions,
            prefix_cache_hits=alloc.prefix_hits,
            prefix_cache_queries=alloc.prefix_queries,
            tokens_per_s=self._rate.per_second(now),
            generated_tokens=self.generated,
        )
        self.snapshot = PoolSnapshot(
            time=time.time(),
            block_size=alloc.block_size,
            num_blocks=alloc.num_blocks,
            bytes_per_block=bytes_per_block,
            owners=owners,
            refcounts=refcounts,
            fills=fills,
            cached=cached,
            block_tokens=tokens,
            sessions=self._session_stats(requests, refcounts, fills, alloc.block_size, now),
            counters=counters,
            model_name=model_name,
        )

    def _session_stats(self, requests: Iterable[Request], refcounts: tuple, fills: tuple,
                       block_size: int, now: float) -> dict[str, SessionStats]:
        sessions: dict[str, dict] = {sid: _new_session() for sid in self._sessions}
        for request in requests:
            stats = sessions.setdefault(request.session_id, _new_session())
            stats["requests"] += 1
            for seq in request.sequences:
                stats["states"].add(seq.state)
                if seq.table is not None:
                    stats["blocks"].update(seq.table.blocks)
                    stats["tokens"] += seq.table.num_tokens
        result = {}
        for sid, s in sessions.items():
            held = s["blocks"]
            rate = self._session_rates.get(sid)
            result[sid] = SessionStats(
                session_id=sid,
                state=_session_state(s["states"]),
                blocks_held=len(held),
                blocks_shared=sum(1 for b in held if refcounts[b] > 1),
                tokens_in_context=s["tokens"],
                wasted_slots=sum(block_size - fills[b] for b in held),
                tokens_per_s=rate.per_second(now) if rate is not None else 0.0,
                requests=s["requests"],
            )
        return result


def _new_session() -> dict:
    return {"states": set(), "blocks": set(), "tokens": 0, "requests": 0}


def _session_state(states: set[SequenceState]) -> SequenceState:
    for state in _STATE_ORDER:
        if state in states:
            return state
    return SequenceState.FINISHED


def _ema(previous: float, value: float, alpha: float = 0.2) -> float:
    return value if previous == 0.0 else previous + alpha * (value - previous)
