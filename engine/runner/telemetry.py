"""Rates and pool snapshots: what the engine thread publishes for monitors to read.

Kept off the step (docs/ARCHITECTURE.md §3.8). Per token the engine makes a handful of
attribute writes (:meth:`Telemetry.token`); per step it updates a few averages. A snapshot
is built only when someone has asked for one (:meth:`Telemetry.read`), at most every
``SNAPSHOT_INTERVAL_S``, between steps, plus once whenever the engine goes idle so the
last state is always shown; it copies state the allocator keeps up to date as blocks
change (``BlockAllocator.block_state`` / ``owner_usage``) and never walks the pool in
Python. Rates count tokens in time buckets (:class:`TokenRates`), so reading one sums a few
buckets, not every token of the window.
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.events import Counters, PoolSnapshot, SequenceState, SessionStats
from engine.kv.blocks import BlockAllocator
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import Request

#: Snapshots are built at most this often (a few per second; the app polls at 10 Hz), and
#: only while someone reads them.
SNAPSHOT_INTERVAL_S = 0.2
RATE_WINDOW_S = 2.0
#: Rates count tokens in buckets of at least this long (closed between steps).
RATE_BUCKET_S = 0.25
#: The shortest span a rate divides by: one token just now is not a rate of thousands.
MIN_RATE_SPAN_S = 0.25
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


class TokenRates:
    """Tokens per second over the last ``RATE_WINDOW_S``, in total and per chat.

    Tokens are counted into an open bucket (:meth:`add`: a comparison and three writes);
    the first token past ``RATE_BUCKET_S`` after the bucket's start closes it into a short
    ring and opens the next at its own time. A rate is the tokens of the buckets that
    started inside the window divided by the time since the first of them started (at
    least ``MIN_RATE_SPAN_S``): the old per-token deque's formula to within a bucket,
    without a sum over every token of the window. A bucket starts at its first token, so
    a chat resuming after a pause is not diluted by the pause.
    """

    def __init__(self) -> None:
        self._start = float("-inf")
        self._total = 0
        self._by_chat: defaultdict[str, int] = defaultdict(int)
        # closed buckets, oldest first: (start, tokens, tokens per chat)
        self._ring: deque[tuple[float, int, dict[str, int]]] = deque()

    def add(self, session_id: str, now: float) -> None:
        if now - self._start >= RATE_BUCKET_S:
            self._open(now)
        self._total += 1
        self._by_chat[session_id] += 1

    def _open(self, now: float) -> None:
        """Close the open bucket (if it counted anything), drop those that left the window,
        and open one at ``now``: once per bucket, never per token."""
        if self._total:
            self._ring.append((self._start, self._total, self._by_chat))
            self._total = 0
            self._by_chat = defaultdict(int)
        while self._ring and self._ring[0][0] < now - RATE_WINDOW_S:
            self._ring.popleft()
        self._start = now

    def forget(self, session_id: str) -> None:
        self._by_chat.pop(session_id, None)

    def per_second(self, now: float, session_id: str | None = None) -> float:
        """The rate of one chat, or of all of them (``session_id`` None)."""
        oldest = now - RATE_WINDOW_S
        first = None
        tokens = 0
        for start, total, by_chat in self._ring:
            if start < oldest:
                continue
            n = total if session_id is None else by_chat.get(session_id, 0)
            if n:
                tokens += n
                first = start if first is None else first
        if self._start >= oldest:
            n = self._total if session_id is None else self._by_chat.get(session_id, 0)
            if n:
                tokens += n
                first = self._start if first is None else first
        if not tokens:
            return 0.0
        return tokens / max(now - first, MIN_RATE_SPAN_S)


class Telemetry:
    """Counts tokens and step times; builds the immutable snapshot other threads read."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock  # seconds (tests pass a manual one)
        self.snapshot: PoolSnapshot | None = None
        self.generated = 0
        self.draft_tokens = 0  # speculative drafts verified
        self.accepted_draft_tokens = 0  # of those, accepted
        self.verify_rows = 0  # sequence-steps that verified drafts
        self.step_ms = 0.0
        self.sched_ms = 0.0
        self.phase_ms = StepTimes()  # an EMA per phase, in ms
        self.batch = 0
        self.rates = TokenRates()
        #: Set by a reader (any thread), cleared by the engine thread when it builds one.
        self.wanted = False
        # Chats shown even while they run nothing, least recently active first, with the
        # priority last set for them (engine.Priority's value; NORMAL until set).
        self._sessions: OrderedDict[str, int] = OrderedDict()
        #: Sessions that sent an incognito request (SessionStats.incognito)
        self.incognito: set[str] = set()
        self._last_snapshot = float("-inf")

    # ---- reading (any thread) -------------------------------------------------------------

    def read(self) -> PoolSnapshot | None:
        """The latest snapshot, asking the engine thread for a fresh one: it builds one at
        its next step boundary once ``SNAPSHOT_INTERVAL_S`` has passed since the last.
        Never waits: a reader that polls (the app, at 10 Hz) sees the pool at most an
        interval plus a step late; a reader that needs a state after an event polls until
        a snapshot shows it."""
        self.wanted = True
        return self.snapshot

    # ---- recording (engine thread) ----------------------------------------------------------

    def add_session(self, session_id: str) -> None:
        self._touch(session_id)

    def _touch(self, session_id: str) -> None:
        """``session_id`` is active now; the least recently active beyond the bound go."""
        self._sessions[session_id] = self._sessions.get(session_id, 1)
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > RECENT_SESSIONS:
            gone, _ = self._sessions.popitem(last=False)
            self.incognito.discard(gone)

    def set_priority(self, session_id: str, priority: int) -> None:
        """The priority the app last set for a chat, shown while it runs nothing. A chat
        the engine does not show (never seen, or forgotten by ``cancel_session``) is not
        brought back by it."""
        if session_id in self._sessions:
            self._sessions[session_id] = int(priority)

    def forget_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self.incognito.discard(session_id)
        self.rates.forget(session_id)

    def token(self, session_id: str, now: float) -> None:
        """One token of ``session_id`` accepted: a few attribute writes, nothing more."""
        self.generated += 1
        self.rates.add(session_id, now)

    def drafts(self, drafted: int, accepted: int) -> None:
        """A sequence verified ``drafted`` drafts and kept ``accepted`` of them."""
        self.draft_tokens += drafted
        self.accepted_draft_tokens += accepted
        self.verify_rows += 1

    def step(self, batch: int, step_s: float, times: StepTimes) -> None:
        """One step ran ``batch`` works in ``step_s``, split in phases as ``times``."""
        self.batch = batch
        self.step_ms = _ema(self.step_ms, step_s * 1000)
        self.sched_ms = _ema(self.sched_ms, (times.schedule + times.bookkeeping) * 1000)
        phase = self.phase_ms
        phase.schedule = _ema(phase.schedule, times.schedule * 1000)
        phase.build = _ema(phase.build, times.build * 1000)
        phase.forward = _ema(phase.forward, times.forward * 1000)
        phase.sample = _ema(phase.sample, times.sample * 1000)
        phase.bookkeeping = _ema(phase.bookkeeping, times.bookkeeping * 1000)

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
        full_bytes_per_block: int = 0,
        disk=None,
    ) -> None:
        """Build a snapshot if one was asked for and the last is ``SNAPSHOT_INTERVAL_S``
        old, or if ``force`` (the engine went idle, or loaded, or stopped). ``disk``: the
        disk tier (engine/kv/disk_tier.py), whose stats the snapshot carries."""
        if not force and not self.wanted:
            return
        now = self.clock()
        if not force and now - self._last_snapshot < SNAPSHOT_INTERVAL_S:
            return
        self.wanted = False
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
            tokens_per_s=self.rates.per_second(now),
            generated_tokens=self.generated,
            build_time_ms=self.phase_ms.build,
            forward_time_ms=self.phase_ms.forward,
            sample_time_ms=self.phase_ms.sample,
            bookkeeping_time_ms=self.phase_ms.bookkeeping,
            draft_tokens=self.draft_tokens,
            accepted_draft_tokens=self.accepted_draft_tokens,
            verify_rows=self.verify_rows,
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
            sessions=self._session_stats(requests, alloc, now),
            counters=counters,
            model_name=model_name,
            paged=paged,
            kv_dtype=kv_dtype,
            full_bytes_per_block=full_bytes_per_block or bytes_per_block,
            disk=disk.stats() if disk is not None else None,
        )

    def _session_stats(self, requests: Iterable[Request], alloc: BlockAllocator,
                       now: float) -> dict[str, SessionStats]:
        """Per chat: what its live sequences say (states, tokens, prompt progress: a loop
        over sequences, not blocks) and what the allocator keeps per owner (blocks held,
        shared, empty slots)."""
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
                    stats["tokens"] += seq.table.num_tokens
                elif seq.state is SequenceState.DECODING:  # on mlx-lm's cache (no table)
                    stats["tokens"] += len(seq.tokens)
                if seq.state in _PROMPT_STATES and (seq.index == 0 or request.forked):
                    stats["prompt_done"] += seq.table.num_computed if seq.table else 0
                    stats["prompt_total"] += len(seq.tokens)
                if seq.waiting_reason and not stats["waiting_reason"] and not seq.finished:
                    stats["waiting_reason"] = seq.waiting_reason
            stats["priority"] = max(stats["priority"], int(request.priority))
        result = {}
        rates = self.rates
        for sid, s in sessions.items():
            held, shared, wasted = alloc.owner_usage(sid)
            result[sid] = SessionStats(
                session_id=sid,
                state=_session_state(s["states"]),
                blocks_held=held,
                blocks_shared=shared,
                tokens_in_context=s["tokens"],
                wasted_slots=wasted,
                tokens_per_s=rates.per_second(now, sid),
                requests=s["requests"],
                prompt_tokens_done=s["prompt_done"],
                prompt_tokens_total=s["prompt_total"],
                priority=s["priority"] if s["requests"] else self._sessions.get(sid, 1),
                waiting_reason=s["waiting_reason"],
                incognito=sid in self.incognito,
            )
        return result


def _new_session() -> dict:
    return {"states": set(), "tokens": 0, "requests": 0, "prompt_done": 0,
            "prompt_total": 0, "priority": 0, "waiting_reason": ""}


def _session_state(states: set[SequenceState]) -> SequenceState:
    for state in _STATE_ORDER:
        if state in states:
            return state
    return SequenceState.FINISHED


def _ema(previous: float, value: float, alpha: float = 0.2) -> float:
    return value if previous == 0.0 else previous + alpha * (value - previous)
