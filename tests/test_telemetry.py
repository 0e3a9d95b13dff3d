"""Telemetry off the step (docs/ARCHITECTURE.md §3.8): snapshots built only when asked, rate
limited, from state the allocator keeps incrementally; rates counted in time buckets.

The references here are independent of the code under test: session stats recomputed by
walking every table's blocks (what the snapshot did before it read the allocator's per-owner
counters), the per-block tuples checked by ``check_snapshot_state`` against the tables, and
rates computed from every token's time with the old sliding-window formula.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.snapshot_cost import busy_pool
from engine.kv.block_table import PENDING
from engine.kv.invariants import check_snapshot_state
from engine.runner.telemetry import (
    MIN_RATE_SPAN_S,
    RATE_BUCKET_S,
    RATE_WINDOW_S,
    SNAPSHOT_INTERVAL_S,
    StepTimes,
    Telemetry,
    TokenRates,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _snapshot(telemetry: Telemetry, alloc, scheduler, requests, force: bool = False):
    telemetry.maybe_snapshot(alloc, scheduler, requests, 1024, "m", force=force)
    return telemetry.snapshot


def _sessions_from_scratch(requests, alloc) -> dict[str, tuple[int, int, int, int]]:
    """(blocks held, shared, empty slots, tokens) per chat, block by block from the tables."""
    _, refcounts, fills, _, _ = alloc.block_state()
    out = {}
    for r in requests:
        blocks: set[int] = set()
        tokens = 0
        for seq in r.sequences:
            if seq.table is not None:
                blocks.update(seq.table.blocks)
                tokens += seq.table.num_tokens
        held, shared, wasted, toks = out.get(r.session_id, (set(), 0, 0, 0))
        out[r.session_id] = (held | blocks, 0, 0, toks + tokens)
    bs = alloc.block_size
    return {sid: (len(b), sum(1 for x in b if refcounts[x] > 1),
                  sum(bs - fills[x] for x in b), t) for sid, (b, _, _, t) in out.items()}


def test_a_busy_pools_snapshot_equals_a_recomputation_from_its_tables() -> None:
    alloc, scheduler, requests = busy_pool(1024, 12, seed=3)
    rng = random.Random(0)
    for step in range(40):  # the engine's life: tokens resolve and append, chats end, fork
        seqs = [s for r in requests for s in r.sequences if s.table is not None]
        for seq in seqs:
            alloc.resolve_pending(seq.table, rng.randrange(1, 100))
            alloc.mark_computed(seq.table)
            if alloc.num_available > 2:
                alloc.append(seq.table, [PENDING])
        if step % 7 == 6:
            gone = requests.pop(rng.randrange(len(requests)))
            for seq in gone.sequences:
                if seq.tokens and seq.table.tokens[-1] == PENDING:
                    alloc.resolve_pending(seq.table, 1)
                alloc.free(seq.table)
                seq.table = None
        telemetry = Telemetry(clock=Clock())
        snap = _snapshot(telemetry, alloc, scheduler, requests, force=True)
        check_snapshot_state(alloc, [s.table for r in requests for s in r.sequences
                                     if s.table is not None])
        expect = _sessions_from_scratch(requests, alloc)
        got = {sid: (s.blocks_held, s.blocks_shared, s.wasted_slots, s.tokens_in_context)
               for sid, s in snap.sessions.items() if sid in expect}
        assert got == expect
        assert any(s.blocks_shared for s in snap.sessions.values())  # forks and prefixes
        assert all(PENDING not in t for t in snap.block_tokens)


def test_a_snapshot_is_built_only_when_asked_and_at_most_every_interval() -> None:
    alloc, scheduler, requests = busy_pool(256, 4)
    clock = Clock()
    telemetry = Telemetry(clock=clock)
    assert _snapshot(telemetry, alloc, scheduler, requests) is None  # nobody asked
    assert telemetry.read() is None  # asking never waits: the latest (none yet)
    first = _snapshot(telemetry, alloc, scheduler, requests)
    assert first is not None and telemetry.read() is first
    clock.now += SNAPSHOT_INTERVAL_S / 2
    assert _snapshot(telemetry, alloc, scheduler, requests) is first  # too soon
    clock.now += SNAPSHOT_INTERVAL_S
    second = _snapshot(telemetry, alloc, scheduler, requests)
    assert second is not first
    clock.now += 10 * SNAPSHOT_INTERVAL_S
    assert _snapshot(telemetry, alloc, scheduler, requests) is second  # not asked since
    assert _snapshot(telemetry, alloc, scheduler, requests, force=True) is not second  # idle


def _old_rate(events: list[tuple[float, str]], now: float, sid: str | None) -> float:
    """The per-token deque's formula: tokens of the last window over the time since the
    first of them (at least MIN_RATE_SPAN_S)."""
    times = [t for t, s in events if now - RATE_WINDOW_S <= t <= now and sid in (None, s)]
    if not times:
        return 0.0
    return len(times) / max(now - times[0], MIN_RATE_SPAN_S)


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.tuples(st.floats(0.0005, 0.6), st.sampled_from("ab")), min_size=1,
                     max_size=400),
       wait=st.floats(0.0, 3.0))
def test_bucketed_rates_follow_the_per_token_window(gaps, wait) -> None:
    rates = TokenRates()
    now = 0.0
    events: list[tuple[float, str]] = []
    for gap, sid in gaps:
        now += gap
        rates.add(sid, now)
        events.append((now, sid))
    now += wait
    for sid in (None, "a", "b"):
        got, exact = rates.per_second(now, sid), _old_rate(events, now, sid)
        if exact == 0.0:  # a bucket starts at a token: none started inside the window
            assert got == 0.0
            continue
        # A bucket starts at its first token, spans RATE_BUCKET_S and
        # leave the window whole: bounded by the tokens and time of one bucket.
        window = [t for t, s in events if now - RATE_WINDOW_S <= t and sid in (None, s)]
        slack = max(gap for gap, _ in gaps) + RATE_BUCKET_S
        lo = (len(window) - _bucket_tokens(events, sid, slack, now)) / (
            max(now - window[0], MIN_RATE_SPAN_S) + slack)
        hi = len(window) / max(now - window[0] - slack, MIN_RATE_SPAN_S) + 1e-9
        assert lo - 1e-9 <= got <= hi + _bucket_tokens(events, sid, slack, now) / MIN_RATE_SPAN_S


def _bucket_tokens(events, sid, slack, now) -> int:
    edge = now - RATE_WINDOW_S
    return sum(1 for t, s in events if edge - slack <= t <= edge + slack and sid in (None, s))


def test_a_steady_stream_reads_its_rate_and_an_idle_one_reads_zero() -> None:
    rates = TokenRates()
    now = 0.0
    for _ in range(3000):  # 100 tokens/s, a step every 10 ms
        now += 0.01
        rates.add("a", now)
    assert rates.per_second(now) == pytest.approx(100.0, rel=0.02)
    assert rates.per_second(now, "a") == pytest.approx(100.0, rel=0.02)
    assert rates.per_second(now, "b") == 0.0
    assert rates.per_second(now + RATE_WINDOW_S + 0.01) == 0.0
    # resuming after a pause: the first tokens are a rate, not diluted by the pause
    now += 30.0
    for _ in range(5):
        now += 0.01
        rates.add("a", now)
    assert rates.per_second(now, "a") == pytest.approx(5 / MIN_RATE_SPAN_S)


def test_per_token_and_per_step_work_is_a_few_attribute_writes() -> None:
    """No list grows per token: a token bumps counters; the ring holds one window."""
    telemetry = Telemetry(clock=Clock())
    for i in range(10_000):
        telemetry.token("a" if i % 2 else "b", 100.0 + i * 1e-4)
        if i % 10 == 0:
            telemetry.step(2, 0.001, StepTimes())
    ring = telemetry.rates._ring
    assert len(ring) <= RATE_WINDOW_S / RATE_BUCKET_S + 1
    assert telemetry.generated == 10_000
