"""The main window without a model: layout commands, sidebar, accessibility, themes."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractButton, QWidget

from app.core.store import Store
from app.ui.theme import theme_manager
from app.window.main_window import MAX_PANES
from tests.app_helpers import engineless_window
from tests.user_path import (
    answer_message_box,
    delete_from_sidebar,
    rename_by_keys,
    search_by_typing,
    shortcut,
    type_and_send,
)


@pytest.fixture
def window(qtbot, qasync_loop, app_env):
    with engineless_window(qtbot, Store(app_env)) as w:
        yield w


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
    first = window.focused_pane
    type_and_send(qtbot, first, "hello there")  # no engine: the message is kept, reply errs
    a = first.session
    assert a.active_path()[0].content == "hello there"
    shortcut(qtbot, window, window.act_new_pane)
    b = window.focused_pane.session
    assert b is not a
    type_and_send(qtbot, window.focused_pane, "milk and eggs")
    rename_by_keys(qtbot, window, "Groceries")  # F2, type, Return
    assert window.store.get_conversation(b.id).title == "Groceries" and b.title == "Groceries"
    assert set(sidebar.visible_ids()) == {a.id, b.id}
    search_by_typing(qtbot, window, "groc")
    assert sidebar.visible_ids() == [b.id]
    search_by_typing(qtbot, window, "THERE")  # message text, case-insensitive
    assert sidebar.visible_ids() == [a.id]
    search_by_typing(qtbot, window, "nothing like this")
    assert sidebar.visible_ids() == [] and sidebar.empty.isVisible()
    search_by_typing(qtbot, window, "")
    assert set(sidebar.visible_ids()) == {a.id, b.id} and not sidebar.empty.isVisible()
    # Delete in the sidebar asks first: Cancel keeps the chat, Delete removes it
    question = delete_from_sidebar(qtbot, window, b.id, "Cancel")
    assert "Groceries" in question
    assert window.store.get_conversation(b.id) is not None and window.pane_for(b.id)
    delete_from_sidebar(qtbot, window, b.id, "Delete")
    assert window.store.get_conversation(b.id) is None and window.pane_for(b.id) is None
    assert window.store.load_messages(b.id) == []
    # Edit > Delete Chat on the last pane's chat: the pane gets another chat
    window.focus_pane(0)
    answer_message_box(qtbot, window.act_delete.trigger, "Delete")
    assert window.store.get_conversation(a.id) is None
    assert len(window.panes) == 1 and window.panes[0].session.id != a.id
    # the unit-level call (no dialog) stays for code that deletes on the user's behalf
    c = window.panes[0].session.id
    assert window.delete_chat(c, confirm=False) and window.store.get_conversation(c) is None


def test_without_a_model_sending_keeps_the_message_and_says_why(window):
    pane = window.focused_pane
    assert pane.send("Are you there?")
    user, reply = pane.session.active_path()
    assert user.content == "Are you there?"
    assert window.store.get_message(user.id).content == "Are you there?"
    assert reply.status == "error" and "No model is loaded" in pane.notice_label.text()


def test_every_control_has_an_accessible_name(window, qtbot):
    window.new_chat(new_pane=True)
    shortcut(qtbot, window, window.act_send_all)  # the compare bar
    assert window.compare_bar.isVisible()
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
    from app.core.app_settings import AppSettings

    for theme, dark in (("dark", True), ("light", False)):
        with qtbot.waitSignal(theme_manager().changed):
            window.theme_actions[theme].trigger()  # View > Theme > Dark / Light
        assert theme_manager().dark is dark
        lightness = window.palette().color(window.backgroundRole()).lightness()
        assert lightness < 80 if dark else lightness > 200
        checked = [v for v, a in window.theme_actions.items() if a.isChecked()]
        assert checked == [theme]
        assert window.settings.theme == theme and AppSettings.load(window.store).theme == theme


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
    from app.window.actions import ACTIONS, TOOLBAR

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


def test_the_per_chat_settings_dialog_changes_only_that_chat(window, qtbot):
    from PySide6.QtWidgets import QDialogButtonBox

    from app.chat.chat_settings_dialog import ChatSettingsDialog
    from tests.user_path import answer_modal, click_button

    pane = window.focused_pane
    other = window.new_chat(new_pane=True)
    other_before = other.session.settings.to_dict()
    window.focus_pane(0)
    seen = []

    def change(dialog) -> None:
        try:
            seen.append(dialog.windowTitle())
            qtbot.keyClicks(dialog.system_prompt, "Answer like a pirate.")
            dialog.sampling.temperature.setValue(0.25)
            dialog.sampling.top_k.setValue(40)
            dialog.sampling.seed.setValue(11)
            click_button(qtbot, dialog, QDialogButtonBox.StandardButton.Ok)
        finally:
            if dialog.isVisible():
                dialog.reject()

    # the pane header's settings button opens it
    answer_modal(qtbot, lambda: qtbot.mouseClick(pane.settings_button, Qt.MouseButton.LeftButton),
                 change, ChatSettingsDialog)
    assert seen and pane.session.title in seen[0]
    s = pane.session.settings
    assert (s.system_prompt, s.sampling.temperature, s.sampling.top_k, s.sampling.seed) == (
        "Answer like a pirate.", 0.25, 40, 11)
    stored = window.store.get_conversation(pane.session.id).settings
    assert stored.to_dict() == s.to_dict()  # saved with the chat
    assert pane.subtitle_label.isVisibleTo(pane) and "pirate" in pane.subtitle_label.text()
    assert other.session.settings.to_dict() == other_before  # the other chat is untouched

    def cancel_changes(dialog) -> None:
        try:
            assert dialog.system_prompt.toPlainText() == "Answer like a pirate."  # shows current
            dialog.sampling.temperature.setValue(1.5)
            click_button(qtbot, dialog, QDialogButtonBox.StandardButton.Cancel)
        finally:
            if dialog.isVisible():
                dialog.reject()

    # Chat > Chat Settings (its shortcut) opens it too; Cancel changes nothing
    answer_modal(qtbot, lambda: shortcut(qtbot, window, window.act_chat_settings),
                 cancel_changes, ChatSettingsDialog)
    assert pane.session.settings.sampling.temperature == 0.25


def test_a_hugging_face_repo_with_a_token_from_settings(window, qtbot, monkeypatch):
    """Settings > Hugging Face repo + token: the token goes to the keychain and to
    huggingface_hub (this process), the engine restarts on the repo, and without a network
    the window says so, naming the repo (no download is possible here)."""
    import huggingface_hub
    from PySide6.QtWidgets import QDialogButtonBox

    from app.settings.dialog import SettingsDialog
    from tests.user_path import answer_modal, click_button

    monkeypatch.delenv("HF_TOKEN", raising=False)  # restored after the test
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: fail at once, not on a timeout
    repo = "pagedchat-tests/no-such-tiny-model"

    def choose_repo(dialog) -> None:
        try:
            qtbot.mouseClick(dialog.kind_hf, Qt.MouseButton.LeftButton,
                             pos=dialog.kind_hf.rect().center())
            dialog.repo_edit.clear()
            qtbot.keyClicks(dialog.repo_edit, repo)
            qtbot.keyClicks(dialog.token_edit, "hf_test_token_456")
            click_button(qtbot, dialog, QDialogButtonBox.StandardButton.Ok)
        finally:
            if dialog.isVisible():
                dialog.reject()

    answer_modal(qtbot, lambda: shortcut(qtbot, window, window.act_settings), choose_repo,
                 SettingsDialog)
    assert window.settings.model_kind == "hf" and window.settings.model_repo == repo
    assert huggingface_hub.get_token() == "hf_test_token_456"  # what the download would send
    qtbot.waitUntil(lambda: window.bridge.status == "error", timeout=120_000)
    assert repo in window.bridge.load_error and window.banner.isVisible()
    assert repo in window.banner.label.text()
    window.bridge.shutdown()
