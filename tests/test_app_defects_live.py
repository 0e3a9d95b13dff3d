"""First-hour defects of the desktop app (issue 11) that need the real default model."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from app.core.records import Status
from tests.app_helpers import WAIT_MS, greedy, last_reply, open_window, wait_idle
from tests.gui_helpers import click_button, when_modal

pytestmark = pytest.mark.model

LONG_PROMPT = "Write a long story about a dragon who learns to read."


@pytest.fixture
def harness(qtbot, qasync_loop, app_env, app_engine):
    h = open_window(qtbot, app_env, app_engine)
    yield h
    h.close()


def _type_and_send(qtbot, pane, text):
    pane.input.setFocus()
    pane.input.setPlainText(text)
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)


def test_deleting_a_chat_while_it_streams(harness, qtbot):
    """Edit ▸ Delete Chat… on a streaming chat: request cancelled, blocks freed, rows gone,
    the other pane keeps its own chat."""
    w, bridge = harness.window, harness.bridge
    keep = w.focused_pane
    keep.session.set_settings(greedy(8))
    _type_and_send(qtbot, keep, "Say hello.")
    wait_idle(qtbot, keep)
    kept_reply = last_reply(keep)
    doomed = w.new_chat(new_pane=True)
    doomed.session.set_settings(greedy(400))
    sid = doomed.session.id
    _type_and_send(qtbot, doomed, LONG_PROMPT)
    qtbot.waitUntil(lambda: len(last_reply(doomed).content) > 10, timeout=WAIT_MS)
    qtbot.waitUntil(
        lambda: (
            bridge.latest_snapshot is not None
            and sid in bridge.latest_snapshot.sessions
            and bridge.latest_snapshot.sessions[sid].blocks_held > 0
        ),
        timeout=WAIT_MS,
    )
    assert doomed.session.busy and bridge.active_requests(sid)
    w.focus_pane(1)
    seen = when_modal(lambda box: click_button(box, "Delete"), QMessageBox)
    w.act_delete.trigger()
    assert seen, "no confirmation dialog was shown"
    # the request is cancelled and its blocks freed (the engine's own snapshot says so)
    qtbot.waitUntil(lambda: not bridge.active_requests(sid), timeout=WAIT_MS)
    engine = bridge.engine
    qtbot.waitUntil(lambda: sid not in engine.snapshot().sessions, timeout=WAIT_MS)
    snap = engine.snapshot()
    assert not any(sid in owners for owners in snap.owners)
    # its rows are gone, and stay gone (no late flush of streamed text writes them back)
    assert harness.store.get_conversation(sid) is None
    assert harness.store.load_messages(sid) == []
    # the remaining pane shows the chat it showed, unchanged, and still works
    assert w.panes == [keep] and w.focused_pane is keep
    assert last_reply(keep).id == kept_reply.id and last_reply(keep).status == kept_reply.status
    assert not keep.session.busy
    _type_and_send(qtbot, keep, "And goodbye.")
    wait_idle(qtbot, keep)  # the engine stepped again, well past a save interval
    assert harness.store.load_messages(sid) == []
    assert harness.store.get_conversation(sid) is None
    assert sid not in w.sidebar.visible_ids()
    assert kept_reply.status in (Status.COMPLETE, Status.LENGTH)


def test_streaming_in_four_panes_never_changes_a_width(harness, qtbot):
    w = harness.window
    w.resize(1280, 800)
    qtbot.waitUntil(lambda: w.width() == 1280)
    for _ in range(3):
        qtbot.keyClick(
            w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier
        )
    for p in w.panes:
        p.session.set_settings(greedy(48))
    qtbot.waitUntil(lambda: w.monitor_dock.isVisible())
    before = (w.width(), [p.width() for p in w.panes], w.monitor_dock.width())
    assert before[0] == 1280
    seen = []
    harness.bridge.snapshotUpdated.connect(
        lambda _s: seen.append((w.width(), [p.width() for p in w.panes], w.monitor_dock.width()))
    )
    qtbot.keyClick(
        w,
        Qt.Key.Key_Return,
        Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier,
    )
    assert w.compare_bar.isVisible()
    w.compare_bar.input.setPlainText("List ten animals, with one sentence about each.")
    qtbot.keyClick(w.compare_bar.input, Qt.Key.Key_Return)
    assert all(p.session.busy for p in w.panes)
    wait_idle(qtbot, *w.panes)
    assert all(last_reply(p).content for p in w.panes)
    assert len(seen) > 3  # sampled while the replies streamed
    assert all(s == before for s in seen), [s for s in seen if s != before][:3]
    assert (w.width(), [p.width() for p in w.panes], w.monitor_dock.width()) == before
