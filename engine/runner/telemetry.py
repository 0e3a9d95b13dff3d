"""Rates and pool snapshots: what the engine thread publishes for monitors to read.

Kept apart from the step so that measuring never changes what a step does; a snapshot is
built at most every ``SNAPSHOT_INTERVAL_S`` (and when the engine goes idle), from the
allocator's cheap per-block tuples.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.events import Counters, PoolSnapshot, SequenceState, SessionStats
from engine.kv.blocks import BlockAllocator
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import Request

SNAPSHOT_INTERVAL_S = 0.05
RATE_WINDOW_S = 2.0
#: Chats with nothing running that a snapshot still lists (the most recently active ones);
#: chats with a live request are always listed. Without a bound, every session id ever
#: seen stayed, and building a snapshot grew to 135 ms after 20,000 one-off sessions.
RECENT_SESSIONS = 64

#: A chat shows the most active state among its sequences.
_STATE_ORDER = (
    SequenceState.DECODING,
    SequenceState.PREFILLING,
    SequenceState.PREEMPTED,
    SequenceState.WAITING,
)


#: States in which a sequence's prompt (or its recompute after preemption) is being fed.
_PROMPT_STATES = (SequenceState.WAITING, SequenceState.PREFILLING, SequenceState.PREEMPTED)


@dataclass
class StepTimes:
    """Seconds one step spent in each phase: build is the batch metadata plus the model's
    lazy graph, sample the sampler's graph, forward is launching and waiting for the
    device (MLX's CPU backend evaluates inside ``mx.async_eval``), bookkeeping is reading
    and accepting the tokens."""

    schedule: float = 0.0
    build: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    bookkeeping: float = 0.0


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
        self.phase_ms = StepTimes()  # an EMA per phase, in ms
        self.batch = 0
        self._rate = Rate()
        self._session_rates: dict[str, Rate] = {}
        # Chats shown even while they run nothing, least recently active first.
        self._sessions: OrderedDict[str, None] = OrderedDict()
        self._last_snapshot = 0.0

    # ---- recording (engine thread) ----------------------------------------------------------

    def add_session(self, session_id: str) -> None:
        self._touch(session_id)

    def _touch(self, session_id: str) -> None:
        """``session_id`` is active now; the least recently active beyond the bound go."""
        self._sessions[session_id] = None
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > RECENT_SESSIONS:
            self._sessions.popitem(last=False)

    def forget_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._session_rates.pop(session_id, None)

    def token(self, session_id: str, now: float) -> None:
        self.generated += 1
        self._rate.add(now, 1)
        self._session_rates.setdefault(session_id, Rate()).add(now, 1)

    def step(self, batch: int, step_s: float, times: StepTimes) -> None:
        """One step ran ``batch`` works in ``step_s``, split in phases as ``times``."""
        self.batch = batch
        self.step_ms = _ema(self.step_ms, step_s * 1000)
        self.sched_ms = _ema(self.sched_ms, (times.schedule + times.bookkeeping) * 1000)
        for name in ("schedule", "build", "forward", "sample", "bookkeeping"):
            value = getattr(times, name) * 1000
            setattr(self.phase_ms, name, _ema(getattr(self.phase_ms, name), value))

    # ---- snapshots --------------------------------------------------------------------------

    def maybe_snapshot(
        self,
        alloc: BlockAllocator,
        scheduler: Scheduler,
        requests: Iterable[Request],
        bytes_per_block: int,
        model_name: str,
        force: bool = False,
        paged: bool = True,
        kv_dtype: str = "",
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
            build_time_ms=self.phase_ms.build,
            forward_time_ms=self.phase_ms.forward,
            sample_time_ms=self.phase_ms.sample,
            bookkeeping_time_ms=self.phase_ms.bookkeeping,
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
            paged=paged,
            kv_dtype=kv_dtype,
        )

    def _session_stats(self, requests: Iterable[Request], refcounts: tuple, fills: tuple,
                       block_size: int, now: float) -> dict[str, SessionStats]:
        requests = list(requests)
        for request in requests:  # a running chat is the most recently active
            self._touch(request.session_id)
        sessions: dict[str, dict] = {sid: _new_session() for sid in self._sessions}
        for request in requests:
            stats = sessions.setdefault(request.session_id, _new_session())
            stats["requests"] += 1
            for seq in request.sequences:
                stats["states"].add(seq.state)
                if seq.table is not None:
                    stats["blocks"].update(seq.table.blocks)
                    stats["tokens"] += seq.table.num_tokens
                elif seq.state is SequenceState.DECODING:  # on mlx-lm's cache (no table)
                    stats["tokens"] += len(seq.tokens)
                if seq.state in _PROMPT_STATES and (seq.index == 0 or request.forked):
                    stats["prompt_done"] += seq.table.num_computed if seq.table else 0
                    stats["prompt_total"] += len(seq.tokens)
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
                prompt_tokens_done=s["prompt_done"],
                prompt_tokens_total=s["prompt_total"],
            )
        for sid in [sid for sid in self._session_rates if sid not in result]:
            del self._session_rates[sid]  # forgotten chats take their rates along
        return result


def _new_session() -> dict:
    return {"states": set(), "blocks": set(), "tokens": 0, "requests": 0, "prompt_done": 0,
            "prompt_total": 0}


def _session_state(states: set[SequenceState]) -> SequenceState:
    for state in _STATE_ORDER:
        if state in states:
            return state
    return SequenceState.FINISHED


def _ema(previous: float, value: float, alpha: float = 0.2) -> float:
    return value if previous == 0.0 else previous + alpha * (value - previous)
