"""Priorities: the chat in front of the user goes first, background work and long pastes yield
(docs/ARCHITECTURE.md §3.3). Scheduler decisions on a real allocator, then the engine's public
API (submit's priority, set_priority, the snapshot's priority and waiting reason)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Engine, EngineConfig, Priority, SamplingParams, SequenceState
from engine.events import FinishReason
from engine.kv.blocks import BlockAllocator
from engine.kv.invariants import check_invariants
from engine.sched.scheduler import (
    BACKGROUND_SHARE,
    LONG_PROMPT_TOKENS,
    WAIT_BATCH,
    WAIT_PREEMPTED,
    WAIT_YIELD,
    Scheduler,
)
from tests.reference import reference_model, wait_until
from tests.test_scheduler import make_seq, run
from tests.tiny_model import budget_mib, make_tiny_model


def with_priority(seq, priority: Priority):
    seq.request.priority = priority
    return seq


def decoding(sched: Scheduler, session: str, priority: Priority, length: int = 3):
    seq = with_priority(make_seq(list(range(1, length + 1)), session), priority)
    sched.add(seq)
    run(sched, sched.schedule())
    assert seq.state is SequenceState.DECODING
    return seq


def test_waiting_prompts_are_admitted_highest_priority_first() -> None:
    sched = Scheduler(BlockAllocator(64, 4), max_batch=2, prefill_chunk=64)
    decoding(sched, "running", Priority.NORMAL)
    background = with_priority(make_seq([5] * 4, "background"), Priority.BACKGROUND)
    normal = with_priority(make_seq([6] * 6, "normal"), Priority.NORMAL)
    interactive = with_priority(make_seq([7] * 20, "interactive"), Priority.INTERACTIVE)
    for seq in (background, normal, interactive):  # arrival order: the background one first
        sched.add(seq)
    plan = sched.schedule()  # room for one more in the batch
    admitted = {w.seq.session_id for w in plan.works} - {"running"}
    assert admitted == {"interactive"}  # not the shortest, not the first to arrive
    assert background.waiting_reason == WAIT_BATCH and normal.waiting_reason == WAIT_BATCH
    assert interactive.waiting_reason == ""


def test_a_long_paste_takes_only_a_share_while_others_decode_and_all_of_it_alone() -> None:
    budget = 256
    paste_tokens = LONG_PROMPT_TOKENS + 500
    alone = Scheduler(BlockAllocator(1024, 16), max_batch=8, prefill_chunk=budget)
    paste = with_priority(make_seq(list(range(paste_tokens)), "paste"), Priority.INTERACTIVE)
    alone.add(paste)
    plan = alone.schedule()
    assert [len(w.tokens) for w in plan.works] == [budget]  # nobody else: full speed

    sched = Scheduler(BlockAllocator(1024, 16), max_batch=8, prefill_chunk=budget)
    chat = decoding(sched, "chat", Priority.NORMAL)
    paste = with_priority(make_seq(list(range(paste_tokens)), "paste"), Priority.INTERACTIVE)
    sched.add(paste)
    share = int(budget * BACKGROUND_SHARE)
    chunks = []
    while paste.state is not SequenceState.DECODING:
        plan = sched.schedule()
        works = {w.seq.session_id: w for w in plan.works}
        assert len(works["chat"].tokens) == 1  # the chat decodes in every step
        chunks.append(len(works["paste"].tokens))
        if paste.num_to_feed - chunks[-1] > LONG_PROMPT_TOKENS:
            assert paste.waiting_reason == WAIT_YIELD
        run(sched, plan)
    # a share per step while it is long, the whole budget once what is left is short
    long_steps = [c for c in chunks if c == share]
    assert long_steps and all(c <= budget for c in chunks) and max(chunks) == budget
    assert sum(chunks) == paste_tokens  # it finished: the share is guaranteed
    assert chat.state is SequenceState.DECODING
    check_invariants(sched.alloc, [s.table for s in sched.running.values()])


def test_a_long_paste_beside_decoding_chats_takes_the_whole_adaptive_budget() -> None:
    """The adaptive budget (engine/sched/prefill_budget.py) already keeps a step within its
    time target for the chats that decode; the background share caps the paste at a share of
    a full chunk, not of that budget (a share of 12 tokens was 3 tokens a step: beside one
    streaming chat a 1,100-token prompt took minutes on the CPU)."""
    sched = Scheduler(BlockAllocator(1024, 16), max_batch=8, prefill_chunk=256)
    decoding(sched, "chat", Priority.INTERACTIVE)
    paste = make_seq(list(range(LONG_PROMPT_TOKENS + 100)), "paste")
    sched.add(paste)
    taken = []
    for budget in (12, 40, 200):
        plan = sched.schedule(budget)
        taken.append({w.seq.session_id: len(w.tokens) for w in plan.works}["paste"])
        run(sched, plan)
    assert taken == [12, 40, int(256 * BACKGROUND_SHARE)]
    assert paste.waiting_reason == WAIT_YIELD  # capped by its share in the last step


def test_a_yielding_paste_still_takes_the_steps_free_tokens() -> None:
    """On a launch-bound GPU a step carries some prompt tokens at a decode step's cost (the
    prefill budget's knee, ``free_tokens``): capping a yielding paste below them slows the
    paste and buys the focused chat nothing.
    It takes what is left of them after the prompts above it, never more than the budget,
    and the share where they are fewer."""
    sched = Scheduler(BlockAllocator(1024, 16), max_batch=8, prefill_chunk=256)
    share = int(256 * BACKGROUND_SHARE)
    decoding(sched, "focused", Priority.INTERACTIVE)
    paste = with_priority(make_seq(list(range(LONG_PROMPT_TOKENS + 1000)), "paste"),
                          Priority.NORMAL)
    sched.add(paste)

    def taken(budget: int, free: int) -> dict[str, int]:
        plan = sched.schedule(budget, free_tokens=free)
        run(sched, plan)
        return {w.seq.session_id: len(w.tokens) for w in plan.works}

    assert taken(200, 160) == {"focused": 1, "paste": 160}  # admitted with them
    assert paste.waiting_reason == WAIT_YIELD  # 40 more would have fit the time budget
    assert taken(200, 0) == {"focused": 1, "paste": share}  # a CPU's step: none are free
    assert taken(200, 40) == {"focused": 1, "paste": share}  # fewer than the share
    assert taken(128, 128) == {"focused": 1, "paste": 128}  # all of the budget is free
    assert paste.waiting_reason == ""
    question = with_priority(make_seq(list(range(7, 57)), "question"), Priority.INTERACTIVE)
    sched.add(question)  # the focused pane's new prompt is read first, from the free tokens
    assert taken(256, 160) == {"focused": 1, "question": 50, "paste": 110}
    assert taken(256, 160) == {"focused": 1, "question": 1, "paste": 160}
    check_invariants(sched.alloc, [s.table for s in sched.running.values()])


def test_background_prompts_yield_to_an_interactive_chat_but_not_to_each_other() -> None:
    budget = 64
    sched = Scheduler(BlockAllocator(256, 16), max_batch=8, prefill_chunk=budget)
    decoding(sched, "focused", Priority.INTERACTIVE)
    api = with_priority(make_seq(list(range(300)), "api"), Priority.BACKGROUND)
    sched.add(api)
    plan = sched.schedule()
    assert {w.seq.session_id: len(w.tokens) for w in plan.works}["api"] == int(
        budget * BACKGROUND_SHARE)

    peers = Scheduler(BlockAllocator(256, 16), max_batch=8, prefill_chunk=budget)
    decoding(peers, "other-api", Priority.BACKGROUND)
    api = with_priority(make_seq(list(range(300)), "api"), Priority.BACKGROUND)
    peers.add(api)
    plan = peers.schedule()  # among background work nobody yields: the whole budget
    assert {w.seq.session_id: len(w.tokens) for w in plan.works}["api"] == budget


def test_a_full_pool_preempts_background_work_before_the_focused_chat() -> None:
    sched = Scheduler(BlockAllocator(4, 4), max_batch=8, prefill_chunk=64)
    background = with_priority(make_seq([1, 2, 3, 4, 5, 6, 7], "background"),
                               Priority.BACKGROUND)
    focused = with_priority(make_seq([9, 8, 7, 6, 5, 4, 3], "focused"), Priority.INTERACTIVE)
    sched.add(background)
    run(sched, sched.schedule())  # the background chat is admitted first
    sched.add(focused)
    preempted = []
    for _ in range(6):  # the four blocks fill up; someone needs a fifth
        plan = sched.schedule()
        preempted += [s.session_id for s in plan.preempted]
        run(sched, plan)
        if preempted:
            break
    # Without priorities the latest admitted (the focused chat) would go.
    assert preempted == ["background"]
    assert background.waiting_reason == WAIT_PREEMPTED
    assert focused.state is SequenceState.DECODING
    check_invariants(sched.alloc, [s.table for s in sched.running.values()])


def test_set_priority_reaches_running_and_waiting_requests_of_that_chat_only() -> None:
    sched = Scheduler(BlockAllocator(64, 4), max_batch=1, prefill_chunk=64)
    running = decoding(sched, "a", Priority.NORMAL)
    waiting = make_seq([4, 5], "a")
    other = make_seq([6, 7], "b")
    sched.add(waiting)
    sched.add(other)
    sched.set_priority("a", Priority.INTERACTIVE)
    assert running.priority is waiting.priority is Priority.INTERACTIVE
    assert other.priority is Priority.NORMAL


# ---- the public API --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama",
                           reference_model().path)


@pytest.mark.parametrize("bad", ["high", 7, -1, 1.5, True, None])
def test_a_bad_priority_is_refused_at_the_door_naming_the_values(tiny, bad) -> None:
    eng = Engine(EngineConfig(model=str(tiny), kv_memory_mib=budget_mib(32, 8), block_size=8,
                              prefill_chunk=16))
    eng.start()
    try:
        assert eng.wait_ready(120), eng.load_error
        with pytest.raises(ValueError, match="INTERACTIVE"):
            eng.submit(prompt_tokens=[1, 2, 3], priority=bad)
        with pytest.raises(ValueError, match="INTERACTIVE"):
            eng.set_priority("chat", bad)
    finally:
        eng.stop()


def test_the_focused_chat_is_served_before_earlier_background_work(tiny) -> None:
    """One batch slot: the chat the user raises to INTERACTIVE while both wait runs first;
    the snapshot shows each chat's priority and why the other waits."""
    eng = Engine(EngineConfig(model=str(tiny), kv_memory_mib=budget_mib(64, 8), block_size=8,
                              prefill_chunk=16, max_batch=1))
    eng.start()
    try:
        assert eng.wait_ready(120), eng.load_error
        forever = SamplingParams(temperature=0.0, max_tokens=100000)
        first = eng.submit(prompt_tokens=[3, 4, 5], params=forever, session_id="first")
        wait_until(lambda: first.token_events >= 1)
        background = eng.submit(prompt_tokens=[6, 7, 8], params=forever, session_id="api",
                                priority=Priority.BACKGROUND)
        later = eng.submit(prompt_tokens=[9, 10, 11], params=forever, session_id="pane",
                           priority=Priority.BACKGROUND)
        eng.set_priority("pane", Priority.INTERACTIVE)  # the user focuses that pane
        first.cancel()
        wait_until(lambda: later.token_events >= 1)
        assert background.token_events == 0  # it arrived first, but it is background work

        def shown() -> bool:
            snap = eng.snapshot()
            api, pane = snap.sessions.get("api"), snap.sessions.get("pane")
            return (api is not None and pane is not None
                    and api.state is SequenceState.WAITING and api.waiting_reason == WAIT_BATCH
                    and api.priority == Priority.BACKGROUND
                    and pane.priority == Priority.INTERACTIVE and pane.waiting_reason == "")

        wait_until(shown)
        later.cancel()
        background.cancel()
        assert all(f.finish_reason is FinishReason.CANCELLED
                   for h in (first, later, background) for f in h.result(60))
    finally:
        eng.stop()


# ---- the app: the user's focus sets the priorities, the monitor shows them ---------------------


@pytest.mark.model
def test_clicking_a_pane_puts_its_chat_first_and_the_monitor_says_so(qtbot, qasync_loop, app_env,
                                                                      app_engine):
    """Two panes streaming: the pane the user clicks into is interactive and the other one
    background, in the engine's own snapshot and in the monitor's chat table."""
    from PySide6.QtCore import Qt

    from app.monitor.legend import STATE
    from tests.app_helpers import greedy, open_window, wait_idle

    harness = open_window(qtbot, app_env, app_engine)
    try:
        w = harness.window
        qtbot.keyClick(w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier
                       | Qt.KeyboardModifier.ShiftModifier)  # a second pane
        first, second = w.panes
        for pane in (first, second):
            pane.session.set_settings(greedy(400))
            pane.input.setFocus()
            pane.input.setPlainText("Write a long story about a lighthouse keeper.")
            qtbot.keyClick(pane.input, Qt.Key.Key_Return)
        qtbot.mouseClick(first.input, Qt.MouseButton.LeftButton)  # the user clicks pane one
        qtbot.waitUntil(lambda: w.focused_pane is first)
        ids = {first.session.id: "interactive", second.session.id: "background"}
        panel = w.monitor_dock.widget()

        def shown() -> bool:
            snap = harness.bridge.latest_snapshot
            if snap is None:
                return False
            for sid, label in ids.items():
                stats = snap.sessions.get(sid)
                want = Priority.INTERACTIVE if label == "interactive" else Priority.BACKGROUND
                row = panel.legend_model.row_of(sid)
                if stats is None or stats.priority != want or row is None or row < 0:
                    return False
                if not panel.legend_model.index(row, STATE).data().endswith(f"· {label}"):
                    return False
            return True

        qtbot.waitUntil(shown, timeout=60_000)
        for pane in (first, second):
            pane.stop()
        wait_idle(qtbot, first, second)
    finally:
        harness.close()
