"""First-hour defects of the desktop app (issue 11), each through the real widgets.

These need no model: the window runs on a bridge without an engine. The ones that need the
real model are in test_app_defects_live.py.
"""

from __future__ import annotations

import pytest
from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtGui import QColor, QContextMenuEvent
from PySide6.QtWidgets import QApplication, QMessageBox

from app.engine_bridge import EngineBridge
from app.main_window import MainWindow
from app.store import Store
from tests.gui_helpers import click_button, trigger_menu_item, when_modal, when_popup_menu


@pytest.fixture
def window(qtbot, qasync_loop, app_env):
    store = Store(app_env)
    bridge = EngineBridge()
    w = MainWindow(store, bridge)
    qtbot.addWidget(w)
    w.show()
    qtbot.waitExposed(w)
    yield w
    w.shutdown_chats()
    store.close()


def _chat_with_message(window, text="hello there", new_pane=False):
    pane = window.new_chat(new_pane=new_pane) if new_pane else window.focused_pane
    pane.send(text)  # no engine: the message is kept, the reply shows an error
    return pane.session


# ---- 1. deleting a chat goes through a real confirmation dialog ------------------------------


def test_delete_from_the_edit_menu_asks_then_deletes(window, qtbot):
    keep = _chat_with_message(window, "keep me")
    doomed = _chat_with_message(window, "delete me", new_pane=True)
    window.focus_pane(1)
    # Cancel first: nothing happens
    seen = when_modal(lambda box: click_button(box, "Cancel"), QMessageBox)
    window.act_delete.trigger()
    assert seen and "delete me" in seen[0].text()
    assert window.store.get_conversation(doomed.id) is not None
    # then the dialog's Delete button
    seen = when_modal(lambda box: click_button(box, "Delete"), QMessageBox)
    window.act_delete.trigger()
    assert seen
    assert window.store.get_conversation(doomed.id) is None
    assert window.store.load_messages(doomed.id) == []
    assert window.pane_for(doomed.id) is None and len(window.panes) == 1
    assert window.panes[0].session is keep


def test_delete_from_the_sidebar_context_menu(window, qtbot):
    a = _chat_with_message(window, "first chat")
    b = _chat_with_message(window, "second chat", new_pane=True)
    sidebar = window.sidebar
    sidebar.reload()
    row = sidebar.proxy.mapFromSource(sidebar.model.index(sidebar.model.row_of(a.id)))
    pos = sidebar.view.visualRect(row).center()
    when_popup_menu(lambda m: trigger_menu_item(m, "Delete…"))
    dialogs = when_modal(lambda box: click_button(box, "Delete"), QMessageBox)
    event = QContextMenuEvent(
        QContextMenuEvent.Reason.Mouse, pos, sidebar.view.viewport().mapToGlobal(pos)
    )
    QApplication.sendEvent(sidebar.view.viewport(), event)
    qtbot.waitUntil(lambda: bool(dialogs))
    qtbot.waitUntil(lambda: window.store.get_conversation(a.id) is None)
    assert window.pane_for(a.id) is None
    assert [p.session for p in window.panes] == [b]
    assert sidebar.visible_ids() == [b.id]


def test_delete_key_in_the_sidebar_on_the_last_pane_shows_another_chat(window, qtbot):
    a = _chat_with_message(window, "only pane chat")
    window.sidebar.reload()
    window.sidebar.select(a.id)
    window.sidebar.view.setFocus()
    when_modal(lambda box: click_button(box, "Delete"), QMessageBox)
    qtbot.keyClick(window.sidebar.view, Qt.Key.Key_Delete)
    assert window.store.get_conversation(a.id) is None
    assert len(window.panes) == 1 and window.panes[0].session.id != a.id
    assert window.panes[0].session.id in {c.id for c in window.store.list_conversations()} or (
        not window.panes[0].session.tree.by_id
    )


# ---- 5. a chat's colour is stored with it and the same everywhere ---------------------------


def _screen_pixel(widget, point):
    """The colour `widget` paints at `point` (a real render through its paintEvent)."""
    return widget.grab().toImage().pixelColor(point)


class PaintCounter(QObject):
    """Counts the paint events that repaint `point` of a widget (a stale picture gets none)."""

    def __init__(self, widget, point):
        super().__init__(widget)
        self.count = 0
        self.point = point
        widget.installEventFilter(self)

    def eventFilter(self, obj, event):
        if event.type() == QEvent.Type.Paint and event.region().contains(self.point):
            self.count += 1
        return False


def _header_dot(pane):
    from PySide6.QtCore import QPoint

    return QPoint(17, pane.header.height() // 2)


def _sidebar_dot(sidebar, cid):
    from PySide6.QtCore import QPoint

    idx = sidebar.proxy.mapFromSource(sidebar.model.index(sidebar.model.row_of(cid)))
    r = sidebar.view.visualRect(idx).adjusted(6, 2, -6, -2)
    return sidebar.view.viewport(), QPoint(r.left() + 14, r.top() + 14)


def _same(c1, c2, tol=12):
    return all(abs(a - b) <= tol for a, b in zip(c1.getRgb()[:3], c2.getRgb()[:3], strict=True))


def _colours_on_screen(qtbot, window, ids):
    """{chat id: (sidebar dot colour, pane header dot colour or None)} read off the screen."""
    window.sidebar.reload()
    window.sidebar.view.viewport().repaint()
    for p in window.panes:
        p.header.repaint()
    out = {}
    for cid in ids:
        vp, pt = _sidebar_dot(window.sidebar, cid)
        pane = window.pane_for(cid)
        out[cid] = (
            _screen_pixel(vp, pt),
            _screen_pixel(pane.header, _header_dot(pane)) if pane is not None else None,
        )
    return out


def test_chat_colours_survive_a_relaunch(qtbot, qasync_loop, app_env):
    from app import colors

    store = Store(app_env)
    w = MainWindow(store, EngineBridge())
    qtbot.addWidget(w)
    w.resize(1400, 900)
    w.show()
    qtbot.waitExposed(w)
    ids = []
    for i in range(6):
        pane = w.new_chat(new_pane=len(w.panes) < 4) if i else w.focused_pane
        pane.send(f"message number {i}")
        ids.append(pane.session.id)
    expected = {cid: QColor(colors.PALETTE[store.get_conversation(cid).color_index]) for cid in ids}
    assert len({c.name() for c in expected.values()}) == 6  # handed out round robin
    before = _colours_on_screen(qtbot, w, ids)
    for cid in ids:
        side, head = before[cid]
        assert _same(side, expected[cid]), (cid, side.name(), expected[cid].name())
        if head is not None:
            assert _same(head, expected[cid])
    w.shutdown_chats()
    w.close()
    store.close()
    colors.forget_all()  # a relaunch is a fresh process

    store = Store(app_env)
    w2 = MainWindow(store, EngineBridge())
    qtbot.addWidget(w2)
    w2.resize(1400, 900)
    w2.show()
    qtbot.waitExposed(w2)
    after = _colours_on_screen(qtbot, w2, ids)
    for cid in ids:
        assert _same(after[cid][0], expected[cid]), (cid, after[cid][0].name())
        if after[cid][1] is not None:
            assert _same(after[cid][1], expected[cid])
    w2.shutdown_chats()
    store.close()


def test_a_reused_pane_takes_the_new_chats_colour(window, qtbot):
    from app import colors

    pane = window.focused_pane
    pane.send("the first chat")
    first = pane.session.id
    qtbot.waitUntil(
        lambda: _same(_screen_pixel(pane.header, _header_dot(pane)), colors.accent_color(first))
    )
    qtbot.waitUntil(lambda: pane.header.isVisible())
    painted = PaintCounter(pane.header, _header_dot(pane))
    qtbot.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)  # same pane
    second = pane.session.id
    assert second != first and window.focused_pane is pane
    want = colors.accent_color(second)
    assert want != colors.accent_color(first)
    # the header repaints by itself (the dot and the bar are painted, not styled) ...
    qtbot.waitUntil(lambda: painted.count > 0)
    # ... in the new chat's colour
    assert _same(_screen_pixel(pane.header, _header_dot(pane)), want)
    # and the monitor's lookup agrees (one place)
    assert colors.color_index(second) == window.store.get_conversation(second).color_index


# ---- 3. row heights follow the width ---------------------------------------------------------

LONG_TEXT = (
    "This is a fairly long message that has to wrap over several lines when the pane is "
    "narrow, so that its height depends on the width of the message list. " * 3
)


def _rows_consistent(view):
    """Every row's rectangle is as tall as what the delegate paints in it, and none overlap."""
    model = view.model()
    rects = [view.visualRect(model.index(r, 0)) for r in range(model.rowCount())]
    for r, rect in enumerate(rects):
        geo = view.row_geometry(r)
        painted = [geo.body, *geo.actions.values()] + (
            [geo.bubble] if not geo.bubble.isNull() else []
        )
        if max(x.bottom() for x in painted) > rect.bottom():
            return False
    return all(a.bottom() < b.top() for a, b in zip(rects, rects[1:], strict=False))


def test_message_rows_follow_a_width_change(window, qtbot):
    pane = window.focused_pane
    for i in range(3):
        assert pane.send(f"{i}: {LONG_TEXT}")
    view = pane.view
    qtbot.waitUntil(lambda: _rows_consistent(view))
    heights = [
        view.visualRect(view.model().index(r, 0)).height() for r in range(view.model().rowCount())
    ]
    window.resize(window.width() - 500, window.height())  # narrower: the text wraps more
    qtbot.waitUntil(lambda: view.viewport().width() < 600)
    qtbot.waitUntil(lambda: _rows_consistent(view))
    taller = [
        view.visualRect(view.model().index(r, 0)).height() for r in range(view.model().rowCount())
    ]
    assert taller[0] > heights[0]  # the rows really did grow with the narrower width
    window.resize(window.width() + 500, window.height())
    qtbot.waitUntil(lambda: view.viewport().width() > 600)
    qtbot.waitUntil(lambda: _rows_consistent(view))
