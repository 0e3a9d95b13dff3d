"""The main window without a model: layout commands, sidebar, accessibility, themes."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractButton, QWidget

from app.core.store import Store
from app.engine_bridge import EngineBridge
from app.main_window import MAX_PANES, MainWindow
from app.theme import theme_manager


@pytest.fixture
def window(qtbot, qasync_loop, app_env):
    store = Store(app_env)
    bridge = EngineBridge()  # no engine: nothing here needs the model
    w = MainWindow(store, bridge)
    qtbot.addWidget(w)
    w.show()
    yield w
    w.shutdown_chats()
    store.close()


def test_panes_open_close_and_focus_from_the_keyboard(window, qtbot):
    assert len(window.panes) == 1
    for n in range(2, MAX_PANES + 1):
        qtbot.keyClick(
            window,
            Qt.Key.Key_N,
            Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier,
        )
        assert len(window.panes) == n
    assert window.new_chat(new_pane=True) is None  # at most four
    assert not window.act_new_pane.isEnabled()
    qtbot.keyClick(window, Qt.Key.Key_3, Qt.KeyboardModifier.ControlModifier)
    assert window.focused_pane is window.panes[2]
    closing = window.panes[2]
    window.act_close_pane.trigger()  # Close (Ctrl/⌘+W)
    assert len(window.panes) == 3 and closing not in window.panes
    while len(window.panes) > 1:
        window.close_focused_pane()
    window.close_focused_pane()  # the last pane stays
    assert len(window.panes) == 1


def test_unused_new_chats_do_not_pile_up(window):
    first = window.focused_pane.session.id
    window.new_chat()  # replaces the empty chat in the focused pane
    assert window.store.get_conversation(first) is None
    assert len(window.store.list_conversations()) == 1


def test_sidebar_rename_search_and_delete(window, qtbot):
    sidebar = window.sidebar
    a = window.focused_pane.session
    a.send("hello there")  # no engine: the message is kept, the reply shows an error
    assert a.active_path()[0].content == "hello there"
    b = window.new_chat(new_pane=True).session
    b.rename("Shopping list")
    sidebar.reload()
    assert set(sidebar.visible_ids()) == {a.id, b.id}
    row = sidebar.model.row_of(b.id)
    assert sidebar.model.setData(sidebar.model.index(row), "Groceries", Qt.ItemDataRole.EditRole)
    assert window.store.get_conversation(b.id).title == "Groceries" and b.title == "Groceries"
    sidebar.set_search("groc")
    assert sidebar.visible_ids() == [b.id]
    sidebar.set_search("THERE")  # message text, case-insensitive
    assert sidebar.visible_ids() == [a.id]
    sidebar.set_search("nothing like this")
    assert sidebar.visible_ids() == [] and sidebar.empty.isVisible()
    sidebar.set_search("")
    assert window.delete_chat(b.id, confirm=False)
    assert window.store.get_conversation(b.id) is None and window.pane_for(b.id) is None
    assert window.delete_chat(a.id, confirm=False)  # the last pane gets another chat
    assert len(window.panes) == 1 and window.panes[0].session.id != a.id


def test_without_a_model_sending_keeps_the_message_and_says_why(window):
    pane = window.focused_pane
    assert pane.send("Are you there?")
    user, reply = pane.session.active_path()
    assert user.content == "Are you there?"
    assert window.store.get_message(user.id).content == "Are you there?"
    assert reply.status == "error" and "No model is loaded" in pane.notice_label.text()


def test_every_control_has_an_accessible_name(window):
    window.new_chat(new_pane=True)
    window.toggle_compare(True)
    missing = []
    for w in window.findChildren(QWidget):
        if not w.isVisibleTo(window) or w.focusPolicy() == Qt.FocusPolicy.NoFocus:
            continue
        if w.metaObject().className() in ("QSplitterHandle", "QDockWidgetTitleButton"):
            continue
        name = w.accessibleName() or (w.text() if isinstance(w, QAbstractButton) else "")
        if not name.strip():
            missing.append(f"{w.metaObject().className()} {w.objectName()}")
    assert not missing, missing


def test_theme_switches_light_and_dark(window, qtbot):
    with qtbot.waitSignal(theme_manager().changed):
        window.set_theme("dark")
    assert theme_manager().dark
    assert window.palette().color(window.backgroundRole()).lightness() < 80
    with qtbot.waitSignal(theme_manager().changed):
        window.set_theme("light")
    assert not theme_manager().dark
    assert window.palette().color(window.backgroundRole()).lightness() > 200
    assert window.theme_actions["light"].isChecked() or window.settings.theme == "light"


def test_monitor_dock_placeholder(window):
    dock = window.findChild(QWidget, "kvMonitorDock")
    assert dock is window.monitor_dock and dock.widget() is not None


def _menu_at(window, path: str):
    menu = None
    for title in path.split("/"):
        entries = (menu.actions() if menu is not None else window.menuBar().actions())
        found = [a.menu() for a in entries if a.menu() is not None and a.text() == title]
        assert found, f"no menu {title!r} on the way to {path!r}"
        menu = found[0]
    return menu


def test_every_row_of_the_action_table_is_wired_to_the_window_and_its_menu(window):
    from app.actions import ACTIONS, TOOLBAR

    def resolve(path: str):  # "focused_pane.stop": through today's window
        target = window
        for attr in path.split("."):
            target = getattr(target, attr)
        return target

    for spec in ACTIONS:
        action = getattr(window, f"act_{spec.key}")
        if spec.adopt:
            assert action is resolve(spec.adopt)()
        else:
            assert callable(resolve(spec.slot)), spec.slot
        if spec.menu is not None:
            assert action in _menu_at(window, spec.menu[0]).actions(), spec.key
    on_toolbar = [a for a in window.toolbar.actions() if a.iconText() and not a.isSeparator()]
    assert [a.iconText() for a in on_toolbar if a in window.actions_by_key.values()] == [
        window.actions_by_key[k].iconText() for k in TOOLBAR if k is not None
    ]


def test_menu_commands_act_on_the_focused_pane(window, qtbot):
    first = window.focused_pane
    second = window.new_chat(new_pane=True)
    _menu_at(window, "&View").actions()[0].trigger()  # Focus Pane 1
    assert window.focused_pane is first
    window.act_focus_1.trigger()
    assert window.focused_pane is second
    window.act_stop.trigger()  # nothing is streaming: a no-op, never an error
    window.act_close_pane.trigger()
    assert window.panes == [first] and window.focused_pane is first


def test_the_monitor_asks_the_window_about_chats(window, qtbot):
    from PySide6.QtCore import QEvent, QPointF
    from PySide6.QtGui import QEnterEvent
    from PySide6.QtWidgets import QApplication

    panel = window.monitor_dock.widget()
    assert panel.chats is window
    a = window.focused_pane
    b = window.new_chat(new_pane=True)
    b.session.rename("Plans")
    assert panel.title(b.session.id) == "Plans" and panel.title("elsewhere") == "elsewhere"
    panel.select_session(a.session.id)  # as a click on its blocks or its legend row does
    assert window.focused_pane is a
    with qtbot.waitSignal(window.chatHovered) as hovered:
        QApplication.sendEvent(b, QEnterEvent(QPointF(5, 5), QPointF(5, 5), QPointF(5, 5)))
    assert hovered.args == [b.session.id] and panel.highlighted == b.session.id
    QApplication.sendEvent(b, QEvent(QEvent.Type.Leave))
    assert panel.highlighted == a.session.id
