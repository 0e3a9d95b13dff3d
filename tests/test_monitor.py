"""The KV monitor on the real engine and the real default model (offscreen Qt).

One engine per module (app_engine); each test builds a fresh main window whose dock holds the
monitor. Checks run inside a slot connected to the bridge's `snapshotUpdated` after the panel's
own, so they see exactly the snapshot the panel has just drawn. Generations are short.
"""

from __future__ import annotations

import html
import re

import pytest
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QEnterEvent, QHelpEvent
from PySide6.QtWidgets import QApplication, QToolTip

from app.monitor.legend import BLOCKS, SHARED, STATE
from app.monitor.monitor import MonitorPanel
from app.monitor.pool_state import CATEGORY_NAMES
from app.monitor.tooltip import visible_text
from app.ui import colors
from tests.app_helpers import WAIT_MS, greedy, open_window, wait_idle

pytestmark = pytest.mark.model

# 40+ tokens, so two chats using it share at least two full 16-token blocks.
SYSTEM = (
    "You are a friendly, concise assistant for a team of engineers who build a chat "
    "application on Apple silicon. Answer in a few short sentences, plainly, without lists, "
    "and say so when you are not sure about something."
)


@pytest.fixture
def harness(qtbot, qasync_loop, app_env, app_engine):
    h = open_window(qtbot, app_env, app_engine)
    yield h
    h.close()


def panel_of(h) -> MonitorPanel:
    panel = h.window.monitor_dock.widget()
    assert isinstance(panel, MonitorPanel), "the dock does not hold the monitor"
    return panel


def expected_category(snap, b: int) -> str:
    r = snap.refcounts[b]
    if r > 1:
        return "shared"
    if r == 1:
        return "held"
    return "cached" if snap.cached[b] else "free"


def mismatches(panel: MonitorPanel, snap) -> list[str]:
    """Everything the panel shows that differs from `snap` (empty when it matches)."""
    m = panel.block_map
    out = []
    if m.snapshot is not snap:
        return ["the map shows another snapshot"]
    for b in range(snap.num_blocks):
        s = m.cell_state(b)
        want = (expected_category(snap, b), snap.owners[b], snap.refcounts[b], snap.fills[b],
                snap.cached[b])
        got = (s.category, s.owners, s.refcount, s.fill, s.cached)
        if got != want:
            out.append(f"block {b}: drew {got}, snapshot {want}")
    model = panel.legend_model
    for sid, st in snap.sessions.items():
        row = model.row_data(sid)
        if row is None:
            out.append(f"no legend row for {sid}")
            continue
        if (row.blocks, row.shared, row.tokens, row.waste) != (
            st.blocks_held, st.blocks_shared, st.tokens_in_context, st.wasted_slots
        ):
            out.append(f"legend row {sid}: {row} vs {st}")
        if row.state != st.state.value:
            out.append(f"legend state {sid}: {row.state} vs {st.state.value}")
    out += counter_mismatches(panel, snap)
    return out


def _num(text: str) -> float:
    return float(re.match(r"[\d,]*\.?\d+", text).group().replace(",", ""))


def _mib(text: str) -> float:
    value, unit = re.search(r"([\d.]+) (MiB|GiB)", text).groups()
    return float(value) * (1024 if unit == "GiB" else 1)


def counter_mismatches(panel: MonitorPanel, snap) -> list[str]:
    """Every counter the panel shows against the snapshot, recomputed here from the
    definitions in the counters' tooltips (to the precision each is displayed with)."""
    n, bs, c = snap.num_blocks, snap.block_size, snap.counters
    held = [b for b in range(n) if snap.refcounts[b] > 0]
    used = len(held)
    cached = sum(1 for b in range(n) if snap.refcounts[b] == 0 and snap.cached[b])
    mib = snap.bytes_per_block / 2**20
    expected = {
        "used": (used, 0), "cached": (cached, 0), "free": (n - used - cached, 0),
        "waste": (100 * (1 - sum(snap.fills[b] for b in held) / (used * bs)) if used else 0, 0.051),
        "batch": (c.batch_size, 0), "rate": (c.tokens_per_s, 0.051),
        "preemptions": (c.preemptions, 0),
    }
    out = []
    value = panel.counters.value
    for key, (want, tol) in expected.items():
        got = _num(value(key))
        if abs(got - want) > tol:
            out.append(f"counter {key}: shows {value(key)!r}, snapshot says {want}")
    for key, blocks in (("used", used), ("cached", cached), ("free", n - used - cached)):
        if abs(_mib(value(key)) - blocks * mib) > max(0.051, 0.006 * blocks * mib):
            out.append(f"counter {key}: shows {value(key)!r} for {blocks} blocks")
    saved = sum(r - 1 for r in snap.refcounts if r > 1) * mib
    if abs(_mib(value("saved")) - saved) > max(0.051, 0.006 * saved):
        out.append(f"counter saved: shows {value('saved')!r}, snapshot says {saved:.2f} MiB")
    if c.prefix_cache_queries:
        pct, queries = map(_num, value("hits").replace("%", "").split(" of "))
        want_pct = 100 * c.prefix_cache_hits / c.prefix_cache_queries
        if abs(pct - want_pct) > 0.51 or queries != c.prefix_cache_queries:
            out.append(f"counter hits: shows {value('hits')!r}, snapshot says "
                       f"{c.prefix_cache_hits}/{c.prefix_cache_queries}")
    if c.step_time_ms and abs(_num(value("step")) - c.step_time_ms) > 0.51:
        out.append(f"counter step: shows {value('step')!r}, snapshot says {c.step_time_ms}")
    return out


def test_the_dock_shows_the_monitor(harness):
    dock = harness.window.monitor_dock
    assert dock.objectName() == "kvMonitorDock" and dock.isVisible()
    panel = panel_of(harness)
    assert panel.accessibleName() == "KV cache monitor"
    for button in (panel.zoom_in_button, panel.zoom_out_button, panel.zoom_fit_button):
        assert button.accessibleName()


def test_map_legend_and_counters_equal_the_engine_snapshot(harness, qtbot, app_engine):
    panel = panel_of(harness)
    pane = harness.window.focused_pane
    pane.session.set_settings(greedy(24))
    sid = pane.session.id
    checked: list[list[str]] = []

    def check(snap) -> None:
        if not checked and any(sid in o for o in snap.owners):
            checked.append(mismatches(panel, snap))

    harness.bridge.snapshotUpdated.connect(check)
    pane.send("Count from one to twenty, in words.")
    qtbot.waitUntil(lambda: bool(checked), timeout=WAIT_MS)
    assert checked[0] == [], "\n".join(checked[0][:10])

    # while it streams: the chat's held blocks are drawn in its pane's accent colour
    snap = panel.block_map.snapshot
    mine = [b for b in range(snap.num_blocks) if snap.owners[b] == (sid,) and snap.fills[b]]
    assert mine
    assert panel.block_map.drawn_color(mine[0]) == colors.accent_color(sid)
    assert panel.legend_model.row_data(sid).name == pane.session.title

    # when the engine is idle its snapshot stops changing: the panel shows exactly it
    wait_idle(qtbot, pane)
    qtbot.waitUntil(lambda: panel.block_map.snapshot is app_engine.snapshot(), timeout=WAIT_MS)
    final = app_engine.snapshot()
    assert mismatches(panel, final) == []
    assert final.used_blocks == 0  # finished: every block is free or cached
    assert panel.legend_model.row_data(sid).state == "finished"
    row = panel.legend_model.row_of(sid)
    assert panel.legend_model.index(row, STATE).data() == "idle"


def test_same_system_prompt_shows_shared_blocks_with_refcount_2(harness, qtbot, app_engine):
    assert app_engine.count_tokens([{"role": "system", "content": SYSTEM}]) >= 40
    w = harness.window
    panel = panel_of(harness)
    a = w.focused_pane
    a.session.set_settings(greedy(24, system=SYSTEM))
    b = w.new_chat(new_pane=True)
    b.session.set_settings(greedy(24, system=SYSTEM))
    ids = {a.session.id, b.session.id}
    seen: list[dict] = []

    def check(snap) -> None:
        if seen:
            return
        shared = [i for i in range(snap.num_blocks) if set(snap.owners[i]) == ids]
        if shared:
            model = panel.legend_model
            seen.append({
                "cells": [panel.block_map.cell_state(i) for i in shared],
                "legend": {sid: model.row_data(sid) for sid in ids},
                "snap": snap,
                "mismatches": mismatches(panel, snap),
                "saved": panel.counters.value("saved"),
            })

    harness.bridge.snapshotUpdated.connect(check)
    a.send("What is a KV cache?")
    b.send("Write a haiku about memory.")
    qtbot.waitUntil(lambda: bool(seen), timeout=WAIT_MS)
    cells = seen[0]["cells"]
    assert seen[0]["mismatches"] == [], "\n".join(seen[0]["mismatches"][:10])
    assert _mib(seen[0]["saved"]) > 0  # shared blocks: sharing saves memory
    assert len(cells) >= 2  # the system prompt fills at least two blocks
    for cell in cells:
        assert cell.category == "shared" and cell.refcount == 2
        assert set(cell.owners) == ids and cell.fill == cell.block_size
    for sid in ids:
        row = seen[0]["legend"][sid]
        assert row is not None and row.shared >= len(cells)
    # a shared block's tooltip names both chats
    tip = panel.block_map.tooltip_text(cells[0].block_id)
    assert a.session.title in tip and b.session.title in tip and "Refcount: 2" in tip
    wait_idle(qtbot, a, b)

    # clicking a chat in the legend highlights its blocks and focuses its pane
    w.focus_pane(1)
    legend = panel.legend
    index = panel.legend_model.index(panel.legend_model.row_of(a.session.id), 0)
    qtbot.mouseClick(
        legend.viewport(), Qt.MouseButton.LeftButton, pos=legend.visualRect(index).center()
    )
    assert panel.highlighted == a.session.id and w.focused_pane is a
    # hovering a pane highlights that chat while the pointer stays
    QApplication.sendEvent(b, QEnterEvent(QPointF(5, 5), QPointF(5, 5), QPointF(5, 5)))
    assert panel.highlighted == b.session.id
    QApplication.sendEvent(b, QEvent(QEvent.Type.Leave))
    assert panel.highlighted == a.session.id


def test_stopping_a_chat_frees_its_blocks_on_the_map(harness, qtbot):
    panel = panel_of(harness)
    m = panel.block_map
    m.clock = lambda: 1000.0  # frozen: flashes stay visible for the assertions
    pane = harness.window.focused_pane
    pane.session.set_settings(greedy(400))
    sid = pane.session.id

    def held() -> list[int]:
        snap = m.snapshot
        return [] if snap is None else [b for b, o in enumerate(snap.owners) if sid in o]

    pane.send("Write a long story about a dragon who learns to read.")
    qtbot.waitUntil(lambda: len(held()) >= 3, timeout=WAIT_MS)
    blocks = held()
    assert all(m.cell_state(b).category in ("held", "shared") for b in blocks)
    pane.stop()
    qtbot.waitUntil(lambda: not held(), timeout=WAIT_MS)
    for b in blocks:
        state = m.cell_state(b)
        assert state.category in ("free", "cached") and sid not in state.owners
    flashing = m.flashing_blocks()
    assert all(flashing.get(b) == "freed" for b in blocks)
    qtbot.waitUntil(
        lambda: (panel.legend_model.row_data(sid) or panel).blocks == 0, timeout=WAIT_MS
    )
    row = panel.legend_model.row_of(sid)
    assert panel.legend_model.index(row, BLOCKS).data() == "0"


def test_tooltip_names_the_block_its_owner_and_its_text(harness, qtbot, app_engine):
    panel = panel_of(harness)
    m = panel.block_map
    pane = harness.window.focused_pane
    pane.session.set_settings(greedy(8))
    pane.send("What is the capital of France?")
    wait_idle(qtbot, pane)
    # after the reply, the prompt's full blocks stay as cached prefix blocks
    qtbot.waitUntil(lambda: m.snapshot is app_engine.snapshot(), timeout=WAIT_MS)
    snap = m.snapshot
    cached = [b for b in range(snap.num_blocks) if m.cell_state(b).category == "cached"]
    assert cached
    b = cached[0]
    text = app_engine.decode(snap.block_tokens[b])
    assert text.strip()
    pos = m.cell_rect(b).center()
    QApplication.sendEvent(m, QHelpEvent(QEvent.Type.ToolTip, pos, m.mapToGlobal(pos)))
    tip = QToolTip.text()
    assert QToolTip.isVisible() and tip == m.tooltip_text(b)
    assert f"<b>Block {b}</b>" in tip and "Refcount: 0" in tip
    assert f"Filled: {snap.block_size} / {snap.block_size}" in tip
    assert "cached prefix block" in tip
    assert html.escape(visible_text(text)) in tip
    QToolTip.hideText()


def test_a_small_pool_shows_preemption_in_the_legend(qtbot, qasync_loop):
    from app.bridges.engine_bridge import EngineBridge
    from app.monitor import create_monitor
    from engine import Engine, EngineConfig, SamplingParams

    # 16 blocks of 16 tokens (720 KiB each) for six chats needing about 30 at their longest
    small = Engine(EngineConfig(kv_memory_mib=16 * 0.703125, block_size=16, max_batch=8))
    small.start()
    try:
        assert small.wait_ready(600), small.load_error
        bridge = EngineBridge(engine=small)
        panel = create_monitor(bridge)
        qtbot.addWidget(panel)
        panel.show()
        qtbot.waitUntil(lambda: bridge.status == "ready", timeout=WAIT_MS)
        states: set[str] = set()

        def record(_snap) -> None:
            model = panel.legend_model
            states.update(model.index(r, STATE).data() for r in range(model.rowCount()))

        bridge.snapshotUpdated.connect(record)
        questions = (
            "What is the capital of France?",
            "Name three colours of the rainbow.",
            "Write a haiku about the sea.",
            "How many legs does a spider have?",
            "Explain what a KV cache is in one sentence.",
            "Give me a short tip for learning to cook.",
        )
        for i, q in enumerate(questions):
            bridge.submit([{"role": "user", "content": q}],
                          SamplingParams(temperature=0.0, max_tokens=40), f"tiny-{i}")
        # the state cell names the priority too ("preempted · interactive")
        qtbot.waitUntil(lambda: any(s.split(" · ")[0] == "preempted" for s in states),
                        timeout=WAIT_MS)
        qtbot.waitUntil(lambda: not bridge.active_requests(), timeout=WAIT_MS)
        qtbot.waitUntil(lambda: panel.block_map.snapshot is small.snapshot(), timeout=WAIT_MS)
        assert int(panel.counters.value("preemptions")) > 0
        assert panel.block_map.snapshot.used_blocks == 0
        snap = panel.block_map.snapshot
        drawn = [panel.block_map.cell_state(b).category for b in range(16)]
        assert drawn == [expected_category(snap, b) for b in range(16)]
        assert set(drawn) <= set(CATEGORY_NAMES) and "cached" in drawn  # finished prefixes
        legend = panel.legend_model
        assert {legend.index(r, SHARED).data() for r in range(legend.rowCount())} <= {"–"}
        bridge.shutdown()
    finally:
        small.stop()


def test_the_timeline_keeps_the_last_60_seconds_of_real_snapshots(harness, qtbot, app_engine):
    """Each snapshot adds one sample equal to its used / cached / shared blocks and tokens/s;
    on a controlled clock, samples older than 60 s leave the drawn window."""
    from app.monitor.timeline import WINDOW_S

    panel = panel_of(harness)
    timeline = panel.timeline
    now = [5000.0]
    timeline.clock = lambda: now[0]
    timeline.samples.clear()
    pane = harness.window.focused_pane
    pane.session.set_settings(greedy(16, system=SYSTEM))
    checks: list[tuple] = []

    def check(snap) -> None:  # runs after the panel's own slot
        s = timeline.samples.series()
        c = snap.counters
        used = sum(1 for r in snap.refcounts if r > 0)
        cached = sum(1 for b in range(snap.num_blocks)
                     if snap.refcounts[b] == 0 and snap.cached[b])
        shared = sum(1 for r in snap.refcounts if r > 1)
        checks.append(((s["t"][-1], s["used"][-1], s["cached"][-1], s["shared"][-1],
                        s["rate"][-1]), (now[0], used, cached, shared, c.tokens_per_s)))
        now[0] += 1.0  # one second between snapshots on the controlled clock

    harness.bridge.snapshotUpdated.connect(check)
    pane.send("Name three rivers.")
    wait_idle(qtbot, pane)
    qtbot.waitUntil(lambda: len(checks) >= 3, timeout=WAIT_MS)
    harness.bridge.snapshotUpdated.disconnect(check)
    for got, want in checks:
        assert got == pytest.approx(want), (got, want)
    assert any(w[1] > 0 for _, w in checks)  # it saw the chat's blocks
    every = timeline.samples.series()["t"]
    assert len(every) >= len(checks)
    window = timeline.samples.series(since=now[0] - WINDOW_S)["t"]
    assert list(window) == [t for t in every if t >= now[0] - WINDOW_S]
    if every[0] < now[0] - WINDOW_S:  # a run longer than a minute: the oldest are out
        assert 0 < len(window) < len(every) and window[0] >= now[0] - WINDOW_S
    now[0] += WINDOW_S + 1
    assert len(timeline.samples.series(since=now[0] - WINDOW_S)["t"]) == 0
    timeline.repaint()  # paints an empty minute without error
