"""The disk tier in the app (issue #27): Settings ▸ Memory, the sidebar's context states,
putting a chat to sleep from its context menu, deleting a chat's blocks, the monitor's
counters. The chat test runs the real default model on an engine with the disk tier on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QContextMenuEvent
from PySide6.QtWidgets import QApplication

from app.core.app_settings import AppSettings
from app.library.sidebar import ContextRole
from app.monitor.counters import CountersWidget
from app.window.context_watch import conversation_tokens
from engine import DiskStats, Engine, EngineConfig
from engine.runner.disk_sync import full_block_hashes
from tests.app_helpers import WAIT_MS, greedy, open_window, wait_idle
from tests.gui_helpers import trigger_menu_item, when_popup_menu
from tests.reference import chat_prompt, greedy_reference, reference_model
from tests.user_path import delete_from_sidebar, shortcut, type_and_send

STATS = DiskStats(folder="/cache/kv/abc", budget_bytes=4 << 30, bytes=300 << 20, files=420,
                  blocks=400, hits=1234, reads=7, writes=420, discarded=0, errors=0)


def test_settings_memory_shows_the_disk_cache_and_clears_it(qtbot) -> None:
    from app.settings.dialog import SettingsDialog

    cleared: list[bool] = []
    settings = AppSettings(kv_cache_dir="/cache/kv")
    dialog = SettingsDialog(settings, disk_stats=STATS, clear_disk=lambda: cleared.append(True))
    qtbot.addWidget(dialog)
    dialog.show()
    tabs = dialog.tabs
    bar = tabs.tabBar()
    index = next(i for i in range(tabs.count()) if tabs.tabText(i).replace("&", "") == "Memory")
    qtbot.mouseClick(bar, Qt.MouseButton.LeftButton, pos=bar.tabRect(index).center())
    page = dialog.disk_page
    assert tabs.currentWidget() is page
    assert "300 MiB in 420 blocks (400 for the loaded model)" in page.holds.text()
    assert "1,234 blocks read back" in page.holds.text()
    qtbot.mouseClick(page.clear_button, Qt.MouseButton.LeftButton)
    assert cleared == [True] and not page.clear_button.isEnabled()
    assert "Cleared" in page.holds.text()
    page.budget_spin.setFocus()
    page.budget_spin.selectAll()
    qtbot.keyClicks(page.budget_spin, "2048")
    chosen = dialog.value()
    assert chosen.disk_budget_mib == 2048 and chosen.kv_cache_dir == "/cache/kv"
    config = chosen.engine_config()
    assert (config.disk_cache_dir, config.disk_budget_mib) == ("/cache/kv", 2048)
    assert chosen.engine_key() != settings.engine_key()  # the engine restarts
    saved = chosen.to_dict()
    assert "kv_cache_dir" not in saved and AppSettings.from_dict(saved).disk_budget_mib == 2048
    page.budget_spin.selectAll()
    qtbot.keyClicks(page.budget_spin, "0")
    assert dialog.value().engine_config().disk_cache_dir is None  # 0: off
    assert page.holds.text().startswith("Off")


def test_a_disk_error_is_told_once(qtbot, tmp_path) -> None:
    from dataclasses import replace
    from types import SimpleNamespace

    from app.core.store import Store
    from tests.app_helpers import engineless_window

    with engineless_window(qtbot, Store(tmp_path)) as w:
        shown: list[str] = []
        w.statusBar().messageChanged.connect(lambda text: text and shown.append(text))
        full = replace(STATS, errors=1, error="The KV disk cache in /x could not be written "
                       "(No space left on device): chats are recomputed instead of read back.")
        watch = w.context_watch  # what the bridge's snapshotUpdated calls, at each poll
        for errors in (1, 2, 3):
            watch.tell_disk_error(SimpleNamespace(disk=replace(full, errors=errors)))
        watch.tell_disk_error(SimpleNamespace(disk=None))
        assert shown == [full.error]


@pytest.fixture(scope="module")
def disk_engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-cache")
    engine = Engine(EngineConfig(model="default", kv_memory_mib=64, max_batch=4,
                                 disk_cache_dir=str(folder)))
    engine.start()
    assert engine.wait_ready(WAIT_MS / 1000), engine.load_error
    yield engine
    engine.stop()


def right_click_chat(window, conversation_id: str, item: str) -> None:
    sidebar = window.sidebar
    sidebar.reload()
    row = sidebar.proxy.mapFromSource(sidebar.model.index(sidebar.model.row_of(conversation_id)))
    pos = sidebar.view.visualRect(row).center()
    menus = when_popup_menu(lambda m: trigger_menu_item(m, item))
    QApplication.sendEvent(sidebar.view.viewport(), QContextMenuEvent(
        QContextMenuEvent.Reason.Mouse, pos, sidebar.view.viewport().mapToGlobal(pos)))
    assert menus, f"no context menu with {item!r}"


def context_of(window, conversation_id: str) -> str:
    model = window.sidebar.model
    return model.data(model.index(model.row_of(conversation_id)), ContextRole)


@pytest.mark.model
def test_the_sidebar_shows_a_chats_context_and_the_user_puts_it_to_sleep(
        qtbot, qasync_loop, app_env, disk_engine, tmp_path: Path) -> None:
    h = open_window(qtbot, app_env, disk_engine)
    try:
        w = h.window
        pane = w.focused_pane
        pane.session.set_settings(greedy(24))
        type_and_send(qtbot, pane, "Write a short poem about the tide coming in over the "
                      "rocks of a small harbour, in four lines.")
        wait_idle(qtbot, pane)
        sid = pane.session.id
        tokens = conversation_tokens(disk_engine, pane.session.prompt_messages(
            pane.session.tree.active_leaf))
        assert disk_engine.context_residency(tokens).blocks >= 2
        qtbot.waitUntil(lambda: context_of(w, sid) == "memory", timeout=WAIT_MS)
        model = w.sidebar.model
        assert "context in memory" in model.data(model.index(model.row_of(sid)),
                                                 Qt.ItemDataRole.AccessibleTextRole)
        right_click_chat(w, sid, "Keep in Memory")  # pinned: evicted last
        hashes = set(full_block_hashes(tokens, disk_engine.model_info.block_size))
        qtbot.waitUntil(lambda: hashes <= disk_engine.runtime.alloc.pinned, timeout=WAIT_MS)
        assert "kept warm" in model.data(model.index(model.row_of(sid)),
                                         Qt.ItemDataRole.AccessibleTextRole)
        right_click_chat(w, sid, "Put to Sleep")  # lets the pin go first
        qtbot.waitUntil(lambda: not disk_engine.runtime.alloc.pinned, timeout=WAIT_MS)
        qtbot.waitUntil(lambda: disk_engine.context_residency(tokens).in_memory == 0,
                        timeout=WAIT_MS)
        assert disk_engine.context_residency(tokens).state == "disk"  # written, then freed
        w.context_watch.refresh()
        qtbot.waitUntil(lambda: context_of(w, sid) == "disk", timeout=WAIT_MS)
        # the KV monitor's counters show the tier (the window's own monitor, polled)
        counters = w.monitor_dock.findChild(CountersWidget)
        qtbot.waitUntil(lambda: "MiB" in counters.value("disk"), timeout=WAIT_MS)
        assert "reads" in counters.value("disk_hits")
        # a chat that is not open is read from the store for the same tokens
        seen = pane.session.prompt_messages(pane.session.tree.active_leaf)
        qtbot.waitUntil(lambda: w.context_watch._stored_messages(sid) == seen, timeout=WAIT_MS)
        # deleting the chat deletes its blocks (no other chat shares them)
        delete_from_sidebar(qtbot, w, sid, "Delete")
        qtbot.waitUntil(lambda: disk_engine.context_residency(tokens).on_disk == 0,
                        timeout=WAIT_MS)
    finally:
        h.close()


@pytest.mark.model
def test_an_incognito_chat_is_kept_nowhere_and_its_memory_never_shared(
        qtbot, qasync_loop, app_env, disk_engine) -> None:
    """File ▸ New Incognito Chat (by its shortcut): the pane says so; the reply is the
    model's own greedy reply; the chat is in no list nor the database; the engine caches none
    of its blocks in memory or on disk; closing its pane ends it."""
    h = open_window(qtbot, app_env, disk_engine)
    try:
        w = h.window
        shortcut(qtbot, w, w.act_new_incognito)
        pane = w.focused_pane
        session = pane.session
        assert session.incognito and "Incognito" in pane.title_label.text()
        session.set_settings(greedy(16))
        text = "Name three rivers of Europe, one per line."
        type_and_send(qtbot, pane, text)
        wait_idle(qtbot, pane)
        reply = session.active_path()[-1]
        expected = reference_model().tokenizer.decode(
            greedy_reference(chat_prompt([{"role": "user", "content": text}]), 16))
        assert reply.content.strip() == expected.strip()
        assert h.store.get_conversation(session.id) is None
        assert session.id not in [c.id for c in h.store.list_conversations()]
        tokens = conversation_tokens(disk_engine, session.prompt_messages(session.tree.active_leaf))
        where = disk_engine.context_residency(tokens)
        assert where.blocks >= 1 and where.in_memory == 0 and where.on_disk == 0
        w.new_chat(new_pane=True)
        w.deck.close(pane)
        assert session.id not in w.manager.sessions
    finally:
        h.close()
