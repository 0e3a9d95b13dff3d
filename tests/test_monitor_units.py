"""The KV monitor without a model: derivation, aggregation, geometry, raster, widgets.

Synthetic PoolSnapshots (hand-written or from bench/monitor_paint.SyntheticPool) stand in for
the engine; the tests on the real engine are in tests/test_monitor.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.monitor_paint import SyntheticPool
from engine.events import Counters, PoolSnapshot, SequenceState, SessionStats

BS = 16
BPB = 737_280


def counters(**kw) -> Counters:
    base = dict(
        steps=10, batch_size=2, step_time_ms=40.0, schedule_time_ms=0.5, preemptions=0,
        prefix_cache_hits=1, prefix_cache_queries=4, tokens_per_s=20.0, generated_tokens=30,
    )
    base.update(kw)
    return Counters(**base)


def snapshot(blocks: list[tuple], sessions: dict | None = None, **counter_kw) -> PoolSnapshot:
    """blocks: (owners, refcount, fill, cached) per block id."""
    owners = tuple(tuple(b[0]) for b in blocks)
    return PoolSnapshot(
        time=0.0,
        block_size=BS,
        num_blocks=len(blocks),
        bytes_per_block=BPB,
        owners=owners,
        refcounts=tuple(b[1] for b in blocks),
        fills=tuple(b[2] for b in blocks),
        cached=tuple(b[3] for b in blocks),
        block_tokens=tuple(tuple(range(100, 100 + b[2])) for b in blocks),
        sessions=sessions or {},
        counters=counters(**counter_kw),
        model_name="test",
    )


FREE_B = ((), 0, 0, False)
CACHED_B = ((), 0, BS, True)


def stats(sid: str, state=SequenceState.DECODING, held=2, shared=0, tokens=20, waste=12,
          rate=5.0) -> SessionStats:
    return SessionStats(sid, state, held, shared, tokens, waste, rate, 1)


# A pool of 8: a shared prompt block (a, b), a's own full + partial, b's partial, a fork of
# c (refcount 2, one owner), a cached prefix block, two free.
EIGHT = [
    (("a", "b"), 2, BS, True),
    (("a",), 1, BS, True),
    (("a",), 1, 5, False),
    (("b",), 1, 3, False),
    (("c",), 2, BS, True),
    CACHED_B,
    FREE_B,
    FREE_B,
]


# ---- pool_state ---------------------------------------------------------------------------


def test_pool_state_categories_owners_and_savings():
    from app.monitor.pool_state import PoolState, SessionIndex

    sessions = SessionIndex()
    state = PoolState(snapshot(EIGHT), sessions)
    cats = [state.block(b).category for b in range(8)]
    assert cats == ["shared", "held", "held", "held", "shared", "cached", "free", "free"]
    assert state.block(0).owners == ("a", "b") and state.block(0).refcount == 2
    assert state.block(2).fill == 5 and state.block(2).block_size == BS
    assert state.block(5).cached and state.block(5).owners == ()
    a, b, c = sessions.index("a"), sessions.index("b"), sessions.index("c")
    assert state.primary[0] == a and state.secondary[0] == b and state.secondary[1] == -1
    assert state.primary[4] == c and state.primary[6] == -1
    assert state.held_by(a, sessions).tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert state.shared_savings_bytes() == 2 * BPB  # blocks 0 and 4 each save one copy
    with pytest.raises(IndexError):
        state.block(8)


def test_small_ints_fall_back_for_large_values():
    from app.monitor.pool_state import small_ints

    assert small_ints((1, 2, 3), 3).tolist() == [1, 2, 3]
    assert small_ints((1, 300, 70_000), 3).tolist() == [1, 300, 70_000]
    assert small_ints(iter([True, False]), 2).tolist() == [1, 0]
    with pytest.raises(ValueError):
        small_ints((1, 2), 3)


def test_aggregate_folds_blocks_into_cells():
    from app.monitor.pool_state import PoolState, SessionIndex, aggregate

    sessions = SessionIndex()
    blocks = EIGHT + [(("c",), 1, BS, True), FREE_B]  # 10 blocks: the last cell holds 2
    state = PoolState(snapshot(blocks), sessions)
    last = np.full(10, -1, dtype=np.int32)
    last[5] = sessions.index("b")
    cells = aggregate(state, 4, len(sessions), last)
    assert cells.count == 3 and cells.present.tolist() == [4, 4, 2]
    assert cells.used.tolist() == [4, 1, 1]
    assert cells.cached.tolist() == [0, 1, 0]
    assert cells.shared.tolist() == [1, 1, 0]
    assert cells.max_ref.tolist() == [2, 2, 1]
    assert cells.used_slots.tolist() == [BS + BS + 5 + 3, BS, BS]
    a, b, c = (sessions.index(s) for s in "abc")
    assert cells.dominant[0] == a and cells.second[0] == b  # a: 3 blocks, b: 2
    assert cells.dominant[1] == c and cells.second[1] == -1
    assert cells.last_owner.tolist() == [-1, -1, -1]  # cells with used blocks: no cached tint
    assert list(cells.blocks_of(2, 10)) == [8, 9] and cells.cell_of(9) == 2
    one = aggregate(state, 1, len(sessions), last)
    assert one.count == 10 and one.last_owner[5] == b and one.dominant[0] == a


# ---- grid ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [64, 1024, 4096, 16384])
def test_fit_grid_shows_every_block_in_the_area(n):
    from app.monitor.grid import MAX_PITCH, MIN_PITCH, fit_grid

    g = fit_grid(n, 400, 300)
    assert g.cells * g.per_cell >= n and g.rows * g.pitch <= 300 and g.cols * g.pitch <= 400
    assert MIN_PITCH <= g.pitch <= MAX_PITCH
    if n <= 1024:
        assert g.per_cell == 1
    if n == 16384:
        assert g.per_cell > 1  # 16k cells of 5 px do not fit 400 x 300


def test_zoom_first_unfolds_then_grows_cells():
    from app.monitor.grid import ZOOM_MAX_PITCH, fit_grid

    g0 = fit_grid(16384, 400, 300)
    g1 = fit_grid(16384, 400, 300, zoom=1)
    assert g1.per_cell == g0.per_cell // 2 and g1.pitch == g0.pitch and g1.zoom == 1
    steps = int(np.log2(g0.per_cell))
    g = fit_grid(16384, 400, 300, zoom=steps + 1)
    assert g.per_cell == 1 and g.pitch > g0.pitch
    top = fit_grid(16384, 400, 300, zoom=99)
    assert top.pitch == ZOOM_MAX_PITCH and not top.can_zoom_in and top.zoom < 99


def test_grid_cell_lookup_round_trips():
    from app.monitor.grid import fit_grid

    g = fit_grid(1000, 300, 300, dpr=2.0)
    for cell in (0, 1, g.cols - 1, g.cols, g.cells - 1):
        x, y = g.cell_origin(cell)
        assert g.cell_at(x + 1, y + 1) == cell
    assert g.cell_at(-1, 0) == -1 and g.cell_at(g.cols * g.pitch, 0) == -1
    assert g.cell_at(0, g.rows * g.pitch + 1) == -1


# ---- colours and raster -------------------------------------------------------------------


def _palette(n_sessions: int = 3):
    from app.monitor.cell_colors import Palette, session_tables

    accents = [0xFF0A7CFF, 0xFFF28C28, 0xFF2DB55D][:n_sessions]
    bg, empty, neutral = 0xFF202020, 0xFF303030, 0xFF808080
    full, pale, cached, hatch = session_tables(accents, bg, empty, neutral)
    return Palette(bg, empty, 0xFFFFFFFF, neutral, full, pale, cached, hatch, True)


def test_plan_bands_follow_fill_and_category():
    from app.monitor.cell_colors import plan
    from app.monitor.pool_state import PoolState, SessionIndex, aggregate

    sessions = SessionIndex()
    state = PoolState(snapshot(EIGHT), sessions)
    pal = _palette()
    cells = aggregate(state, 1, len(sessions))
    p = plan(cells, BS, pal, 16)
    a, b = sessions.index("a"), sessions.index("b")
    assert p.h1.tolist()[:4] == [16, 16, 5, 3] and p.h2[2] == 16  # pale above the tokens
    assert p.c1[2] == pal.full[a] and p.c2[2] == pal.pale[a]
    assert p.split[0] and p.a1[0] == pal.full[b] and not p.split[1]  # two chats: diagonal
    assert p.mark.tolist() == [True, False, False, False, True, False, False, False]
    assert p.hatch[5] == 1 and p.h1[5] == 16 and p.h1[6] == 0  # cached hatched; free empty
    lit = plan(cells, BS, pal, 16, highlight=state.held_by(b, sessions))
    assert lit.c1[3] == p.c1[3] and lit.c1[2] != p.c1[2]  # b's block kept, a's block faded
    assert plan(cells, BS, pal, 16, corner_marks=False).mark.sum() == 0


def test_rasterize_draws_bands_gaps_and_marks():
    from app.monitor.grid import Grid
    from app.monitor.raster import CellPaint, rasterize

    n = 3
    g = Grid(num_blocks=n, per_cell=1, cols=2, pitch=10, gap=2)
    red, pale, empty, bg, mark = 0xFFFF0000, 0xFFFF8080, 0xFF333333, 0xFF000000, 0xFFFFFFFF
    paint = CellPaint(
        c1=np.full(n, red, np.uint32), c2=np.full(n, pale, np.uint32),
        c3=np.full(n, empty, np.uint32), h1=np.array([8, 2, 0], np.int32),
        h2=np.array([8, 8, 0], np.int32), a1=np.full(n, red, np.uint32),
        a2=np.full(n, pale, np.uint32), split=np.zeros(n, bool), hatch=np.zeros(n, np.int8),
        hatch_color=np.full(n, empty, np.uint32), mark=np.array([False, True, False]),
    )
    img = rasterize(paint, g, 0, g.rows, bg, mark)
    assert img.shape == (20, 20)
    assert img[4, 4] == red  # a full cell
    assert img[7, 14] == red and img[5, 14] == pale  # 2 px of tokens, pale above
    assert img[0, 16] == mark and img[7, 11] == red  # corner mark of a shared cell
    assert img[0, 17] == bg  # softened corner
    assert img[14, 4] == empty  # a free cell
    assert img[8, 4] == bg and img[4, 9] == bg  # the gaps
    assert img[15, 15] == bg  # past the last cell
    part = rasterize(paint, g, 1, 2, bg, mark)
    assert (part == img[10:20]).all()


def test_changed_cells_finds_only_what_differs():
    from dataclasses import replace

    from app.monitor.cell_colors import changed_cells, plan
    from app.monitor.pool_state import PoolState, SessionIndex, aggregate

    sessions = SessionIndex()
    p = plan(aggregate(PoolState(snapshot(EIGHT), sessions), 1, 3), BS, _palette(), 16)
    q = replace(p, h1=p.h1.copy())
    q.h1[2] += 1
    assert changed_cells(p, q).tolist() == [i == 2 for i in range(8)]


# ---- counters and timeline ----------------------------------------------------------------


def test_counters_agree_with_the_snapshot_definitions():
    from app.monitor.counters import pool_counters
    from app.monitor.pool_state import PoolState, SessionIndex

    snap = SyntheticPool(1024, seed=5).snapshot()
    c = pool_counters(PoolState(snap, SessionIndex()))
    assert (c.used, c.cached, c.free) == (
        snap.used_blocks, snap.cached_free_blocks, snap.free_blocks
    )
    assert c.shared == snap.shared_blocks
    assert c.waste_fraction == pytest.approx(snap.waste_fraction)
    assert c.saved_bytes == sum(r - 1 for r in snap.refcounts if r > 1) * snap.bytes_per_block
    assert c.hit_rate == pytest.approx(0.7) and c.batch == snap.counters.batch_size


def test_samples_ring_buffer_keeps_the_newest_in_order():
    from app.monitor.timeline import Samples, nice_ceiling

    s = Samples(capacity=4)
    for i in range(6):
        s.add(float(i), i, 0, 0, 0.0)
    assert len(s) == 4 and s.series()["t"].tolist() == [2, 3, 4, 5]
    assert s.series(since=4)["used"].tolist() == [4, 5]
    assert [nice_ceiling(v) for v in (0, 0.7, 3, 20, 21, 499)] == [1, 1, 5, 20, 50, 500]


# ---- the widgets on synthetic snapshots ---------------------------------------------------


@pytest.fixture
def block_map(qtbot):
    from app.monitor.block_map import BlockMap

    w = BlockMap()
    w.resize(400, 300)
    w.set_viewport_size(w.size())
    qtbot.addWidget(w)
    w.show()
    return w


def test_block_map_draws_what_the_snapshot_says(block_map):
    from app.ui import colors

    snap = snapshot(EIGHT)
    block_map.set_snapshot(snap)
    for b in range(8):
        s = block_map.cell_state(b)
        assert s.owners == snap.owners[b] and s.refcount == snap.refcounts[b]
        assert s.fill == snap.fills[b] and s.cached == snap.cached[b]
    assert block_map.drawn_color(1) == colors.accent_color("a")
    assert block_map.drawn_color(3) == colors.accent_color("b")  # filled bottom of a partial
    assert block_map.drawn_color(6) != block_map.drawn_color(1)
    tip = block_map.tooltip_text(0)
    assert "Block 0" in tip and "a, b" in tip and "Refcount: 2" in tip and "16 / 16" in tip


def test_block_map_aggregates_big_pools_and_zoom_unfolds(block_map):
    snap = SyntheticPool(16384, seed=1).snapshot()
    block_map.set_snapshot(snap)
    g = block_map.grid
    assert g is not None and g.per_cell > 1
    assert block_map.cell_of(g.per_cell) == 1
    tip = block_map.tooltip_text(g.per_cell)
    assert f"Blocks {g.per_cell}–{2 * g.per_cell - 1}" in tip
    block_map.zoom_in()
    assert block_map.grid.per_cell == g.per_cell // 2
    assert block_map.minimumHeight() > 300  # zoomed: the map scrolls
    block_map.zoom_fit()
    assert block_map.grid.per_cell == g.per_cell and block_map.minimumHeight() == 0
    state = block_map.cell_state(123)
    assert state.refcount == snap.refcounts[123] and state.owners == snap.owners[123]


def test_allocated_and_freed_blocks_flash_then_fade(block_map):
    now = [100.0]
    block_map.clock = lambda: now[0]
    before = list(EIGHT)
    block_map.set_snapshot(snapshot(before))
    after = list(before)
    after[6] = (("b",), 1, 1, False)  # allocated
    after[2] = FREE_B  # freed
    block_map.set_snapshot(snapshot(after))
    assert block_map.flashing_blocks() == {6: "allocated", 2: "freed"}
    block_map.repaint()  # paints the flash (numpy blend) without error
    now[0] += 0.6
    assert block_map.flashing_blocks() == {}


def test_highlight_fades_other_chats(block_map):
    block_map.set_snapshot(snapshot(EIGHT))
    before = block_map.drawn_color(1), block_map.drawn_color(3)
    block_map.set_highlight("b")
    assert block_map.drawn_color(3) == before[1] and block_map.drawn_color(1) != before[0]
    block_map.set_highlight(None)
    assert block_map.drawn_color(1) == before[0]


def test_only_changed_rows_are_redrawn(block_map):
    pool = SyntheticPool(1024, seed=2)
    block_map.set_snapshot(pool.snapshot())
    block_map.repaint()
    image = block_map._image
    for _ in range(3):
        pool.step()
        block_map.set_snapshot(pool.snapshot())
        block_map.repaint()
    assert block_map._image is image  # kept, patched in place
    fresh = block_map._rasterize(*block_map._image_rows)
    assert (fresh == block_map._image_buf).all() or block_map._badges()


def test_legend_updates_rows_in_place(qtbot):
    from app.monitor.legend import BLOCKS, STATE, LegendModel, LegendView

    model = LegendModel()
    view = LegendView(model)
    qtbot.addWidget(view)
    names = {"a": "First chat", "b": "Second"}.get
    model.update_from(snapshot(EIGHT, {"a": stats("a"), "b": stats("b")}), lambda s: names(s) or s)
    assert model.rowCount() == 2 and model.index(0, 0).data() == "First chat"
    view.select_session("b")
    inserted, removed = [], []
    model.rowsInserted.connect(lambda *a: inserted.append(a))
    model.rowsRemoved.connect(lambda *a: removed.append(a))
    later = {"a": stats("a", held=5), "b": stats("b", SequenceState.PREEMPTED, held=0)}
    model.update_from(snapshot(EIGHT, later), lambda s: names(s) or s)
    assert not inserted and not removed and view.selected_session() == "b"
    assert model.index(0, BLOCKS).data() == "5" and model.index(1, STATE).data() == "preempted"
    model.update_from(snapshot(EIGHT, {"b": stats("b")}), lambda s: s)
    assert model.rowCount() == 1 and model.session_at(0) == "b"


class _FakeBridge:
    """Just what the panel reads from EngineBridge (no engine)."""

    def __init__(self) -> None:
        from PySide6.QtCore import QObject, Signal

        class Signals(QObject):
            snapshotUpdated = Signal(object)

        self._signals = Signals()
        self.snapshotUpdated = self._signals.snapshotUpdated
        self.latest_snapshot = None
        self.engine = None


def test_panel_pages_from_waiting_to_content(qtbot):
    from app.monitor import create_monitor
    from app.monitor.monitor import CONTENT, WAITING

    bridge = _FakeBridge()
    panel = create_monitor(bridge)
    qtbot.addWidget(panel)
    panel.show()
    assert panel.pages.currentIndex() == WAITING
    bridge.snapshotUpdated.emit(snapshot(EIGHT, {"a": stats("a")}))
    assert panel.pages.currentIndex() == CONTENT
    assert panel.counters.value("used") .startswith("5 ·")
    assert panel.counters.value("saved") == "1.4 MiB"
    assert len(panel.timeline.samples) == 1


def test_clicking_a_block_selects_its_chat(qtbot):
    from PySide6.QtCore import Qt

    from app.monitor import create_monitor

    bridge = _FakeBridge()
    panel = create_monitor(bridge)
    panel.resize(380, 760)
    qtbot.addWidget(panel)
    panel.show()
    bridge.snapshotUpdated.emit(snapshot(EIGHT, {"a": stats("a"), "b": stats("b")}))
    m = panel.block_map
    qtbot.mouseClick(m, Qt.MouseButton.LeftButton, pos=m.cell_rect(3).center())
    assert panel.highlighted == "b" and panel.legend.selected_session() == "b"
    qtbot.mouseClick(m, Qt.MouseButton.LeftButton, pos=m.cell_rect(7).center())  # free block
    assert panel.highlighted is None


def test_synthetic_pool_keeps_allocator_invariants():
    pool = SyntheticPool(512, seed=9)
    for _ in range(200):
        pool.step()
        snap = pool.snapshot()
        held: dict[int, int] = {}
        for seq in pool.seqs:
            for b in seq.blocks:
                held[b] = held.get(b, 0) + 1
        assert all(snap.refcounts[b] == held.get(b, 0) for b in range(snap.num_blocks))
        assert snap.used_blocks + snap.cached_free_blocks + snap.free_blocks == 512


def test_a_hidden_panel_keeps_the_timeline_and_catches_up_when_shown(qtbot):
    from app.monitor import create_monitor

    bridge = _FakeBridge()
    panel = create_monitor(bridge)
    qtbot.addWidget(panel)
    pool = SyntheticPool(256, seed=4)
    for _ in range(3):
        pool.step()
        bridge.snapshotUpdated.emit(pool.snapshot())
    assert panel.block_map.snapshot is None  # hidden: no map work
    assert len(panel.timeline.samples) == 3
    last = pool.snapshot()
    bridge.snapshotUpdated.emit(last)
    panel.show()
    assert panel.block_map.snapshot is last and panel.block_map.flashing_blocks() == {}
    assert panel.legend_model.rowCount() == len(last.sessions)


def test_a_theme_change_recolours_the_map(block_map):
    from PySide6.QtGui import QColor, QPalette

    block_map.set_snapshot(snapshot(EIGHT))
    before = block_map.drawn_color(7)  # a free cell
    dark = QPalette(block_map.palette())
    for role in (QPalette.ColorRole.Window, QPalette.ColorRole.Base):
        dark.setColor(role, QColor("#101010"))
    dark.setColor(QPalette.ColorRole.Text, QColor("#f0f0f0"))
    block_map.setPalette(dark)
    after = block_map.drawn_color(7)
    assert after != before and after.lightness() < 64
