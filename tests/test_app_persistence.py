"""Persistence across restarts of the window (and of the process), settings and secrets."""

from __future__ import annotations

import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialogButtonBox, QMessageBox

from app.core.app_settings import AppSettings
from app.core.records import Status
from tests.app_helpers import WAIT_MS, greedy, last_reply, open_window, wait_idle
from tests.manual_clock import ManualClock
from tests.reference import chat_prompt, greedy_reference, reference_model
from tests.user_path import (
    answer_modal,
    click_action,
    click_button,
    rename_by_keys,
    search_by_typing,
    shortcut,
    type_and_send,
)

OK = QDialogButtonBox.StandardButton.Ok
CANCEL = QDialogButtonBox.StandardButton.Cancel

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parent.parent


def test_round_trip_across_a_window_restart(qtbot, qasync_loop, app_env, app_engine):
    h = open_window(qtbot, app_env, app_engine)
    w = h.window
    a = w.focused_pane
    a.session.set_settings(greedy(8, system="Answer in one word."))
    type_and_send(qtbot, a, "Name a fruit.")
    wait_idle(qtbot, a)
    first = last_reply(a)
    s = a.session.settings
    s.sampling = dataclasses.replace(s.sampling, temperature=1.0, seed=3)
    a.session.set_settings(s)
    click_action(qtbot, a, first.id, "regenerate")
    wait_idle(qtbot, a)
    click_action(qtbot, a, last_reply(a).id, "prev")  # show the first reply again
    assert last_reply(a).id == first.id
    shortcut(qtbot, w, w.act_new_pane)
    b = w.focused_pane
    assert b is not a and len(w.panes) == 2
    b.session.set_settings(greedy(6))
    type_and_send(qtbot, b, "Say hi.")
    wait_idle(qtbot, b)
    rename_by_keys(qtbot, w, "Greetings")
    assert b.session.title == "Greetings"
    shortcut(qtbot, w, w.act_monitor)  # hide the KV monitor dock
    shortcut(qtbot, w, w.act_sidebar)  # and the sidebar
    assert not w.monitor_dock.isVisible() and not w.sidebar.isVisible()
    w.resize(1200, 800)
    qtbot.waitUntil(lambda: w.pane_splitter.width() > 600)
    w.pane_splitter.setSizes([700, 300])
    sizes = w.pane_splitter.sizes()
    size = w.size()
    w.focus_pane(0)
    path_a = [(m.id, m.content) for m in a.session.active_path()]
    path_b = [(m.id, m.content) for m in b.session.active_path()]
    ids = [a.session.id, b.session.id]
    h.close()

    h2 = open_window(qtbot, app_env, app_engine)
    w2 = h2.window
    assert [p.session.id for p in w2.panes] == ids
    a2, b2 = w2.panes
    assert w2.focused_pane is a2
    assert [(m.id, m.content) for m in a2.session.active_path()] == path_a
    assert [(m.id, m.content) for m in b2.session.active_path()] == path_b
    assert a2.session.tree.sibling_position(path_a[-1][0]) == (0, 2)  # alternatives survive
    assert a2.session.settings.system_prompt == "Answer in one word."
    assert a2.session.settings.sampling.seed == 3
    assert b2.session.title == "Greetings"
    assert not w2.monitor_dock.isVisible() and not w2.sidebar.isVisible()
    if w2.screen().availableGeometry().width() >= 1200:  # else the screen clamps the window
        qtbot.waitUntil(lambda: w2.size() == size)
        assert abs(w2.pane_splitter.sizes()[0] - sizes[0]) <= 2
    search_by_typing(qtbot, w2, "Greet")  # Find shows the hidden sidebar
    assert w2.sidebar.isVisible() and w2.sidebar.visible_ids() == [b.session.id]
    search_by_typing(qtbot, w2, "fruit")  # message content is searched too
    assert w2.sidebar.visible_ids() == [a.session.id]
    search_by_typing(qtbot, w2, "")
    assert set(ids) <= set(w2.sidebar.visible_ids())
    h2.close()


def test_reply_interrupted_by_quitting_is_kept_and_can_be_regenerated(
    qtbot, qasync_loop, app_env, app_engine
):
    h = open_window(qtbot, app_env, app_engine)
    pane = h.window.focused_pane
    pane.session.set_settings(greedy(300))
    pane.send("Write a long story about a lighthouse keeper.")
    reply_id = last_reply(pane).id
    # wait until part of the reply has been written to the database while streaming
    qtbot.waitUntil(
        lambda: (
            (m := h.store.get_message(reply_id)) is not None
            and m.status == Status.STREAMING
            and len(m.content) > 0
            and pane.session.busy
        ),
        timeout=WAIT_MS,
    )
    h.close()  # quit while streaming: cancel, save partial text, mark it interrupted
    h2 = open_window(qtbot, app_env, app_engine)
    pane2 = h2.window.focused_pane
    reply = last_reply(pane2)
    assert reply.id == reply_id and reply.status == Status.INTERRUPTED and reply.content
    row = pane2.model.row_of(reply.id)
    assert pane2.model.data(pane2.model.index(row)) == reply.content
    pane2.session.set_settings(greedy(6))
    click_action(qtbot, pane2, reply.id, "regenerate")
    assert pane2.session.busy
    wait_idle(qtbot, pane2)
    assert len(pane2.session.tree.siblings(reply_id)) == 2
    assert last_reply(pane2).status in (Status.COMPLETE, Status.LENGTH)
    h2.close()


def test_a_kill_loses_only_the_text_streamed_since_the_last_save_tick(
    qtbot, qasync_loop, app_env, app_engine, monkeypatch
):
    """The streaming reply's save timer, on a controlled clock: what a kill would leave on
    disk (read through another connection) is, after each tick, exactly the text streamed so
    far; between ticks nothing more, and the ticks come every 1000 ms while streaming."""
    import app.chat.session as session_module

    clock = ManualClock()
    monkeypatch.setattr(session_module, "QTimer", clock.timer_class())
    h = open_window(qtbot, app_env, app_engine)
    pane = h.window.focused_pane
    pane.session.set_settings(greedy(300))
    sid = pane.session.id
    streamed: list[str] = []
    h.bridge.tokenReceived.connect(
        lambda s, _rid, _i, text: streamed.append(text) if s == sid else None)
    db = sqlite3.connect(f"file:{app_env / 'pagedchat.sqlite3'}?mode=ro", uri=True)

    def on_disk(message_id: str) -> str:
        return db.execute("SELECT content FROM messages WHERE id=?", (message_id,)).fetchone()[0]

    assert not clock.active()  # no save timer runs while nothing streams
    type_and_send(qtbot, pane, "Write a long story about a lighthouse keeper.")
    reply_id = last_reply(pane).id
    assert [t.interval for t in clock.active()] == [1000]  # "about once a second"
    for round_ in range(3):
        n = len(streamed)
        qtbot.waitUntil(lambda n=n: len(streamed) >= n + 4, timeout=WAIT_MS)
        text = "".join(streamed)
        assert last_reply(pane).content == text
        saved = on_disk(reply_id)
        assert text.startswith(saved) and len(saved) < len(text)  # the unsaved tail
        clock.advance(999)
        assert on_disk(reply_id) == saved  # no save before the tick
        clock.advance(1)
        assert on_disk(reply_id) == text, f"tick {round_}: the save lost streamed text"
    shortcut(qtbot, h.window, h.window.act_stop)
    wait_idle(qtbot, pane)
    assert not clock.active()
    assert on_disk(reply_id) == last_reply(pane).content
    db.close()
    h.close()


def test_killed_mid_reply_keeps_the_saved_text(qtbot, qasync_loop, app_env, app_engine):
    """A real crash: the app process is SIGKILLed while three greedy replies stream; what was
    saved comes back as interrupted replies, each the start of its chat's true reply."""
    from app.demo import DEMO_CHATS, DEMO_MAX_TOKENS

    expected = [
        reference_model().tokenizer.decode(greedy_reference(chat_prompt(
            [{"role": "system", "content": system}, {"role": "user", "content": prompt}]),
            DEMO_MAX_TOKENS))
        for _title, system, prompt in DEMO_CHATS
    ]
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.main", "--demo", "--data-dir", str(app_env)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    db = app_env / "pagedchat.sqlite3"

    def streamed() -> dict[str, str]:
        """Replies saved while streaming, longer than the first token (a timer save)."""
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
            rows = con.execute(
                "SELECT id, content FROM messages WHERE status='streaming' AND length(content) > 20"
            ).fetchall()
            con.close()
            return dict(rows)
        except sqlite3.Error:
            return {}

    try:
        deadline = time.monotonic() + WAIT_MS / 1000
        while not streamed():
            assert proc.poll() is None, "the app exited before streaming"
            assert time.monotonic() < deadline, "no reply was saved while streaming"
            time.sleep(0.05)  # polling another process's database, not synchronisation
        seen = streamed()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    h = open_window(qtbot, app_env, app_engine)
    replies = {
        m.id: m
        for s in h.window.manager.sessions.values()
        for m in s.tree.by_id.values()
        if m.role == "assistant"
    }
    interrupted = [m for m in replies.values() if m.status == Status.INTERRUPTED]
    assert interrupted
    for mid, text in seen.items():  # saved text survives the kill (later saves only add)
        assert replies[mid].status == Status.INTERRUPTED and replies[mid].content.startswith(text)
    for m in interrupted:  # and is genuine: the start of one chat's greedy reply
        assert any(e.startswith(m.content) and m.content for e in expected), m.content
    pane = h.window.pane_for(interrupted[0].conversation_id)
    assert pane is not None and last_reply(pane).status == Status.INTERRUPTED
    h.close()


def open_settings_and(qtbot, window, answer) -> list:
    """Open Settings with its shortcut and let ``answer(dialog)`` act in the modal dialog
    (which must end it); the dialog is cancelled if ``answer`` fails, so a failure never
    leaves a modal loop running. Returns whatever ``answer`` returned, in a list."""
    from app.settings.dialog import SettingsDialog

    results = []

    def run(dialog) -> None:
        try:
            results.append(answer(dialog))
        finally:
            if dialog.isVisible():
                dialog.reject()

    answer_modal(qtbot, lambda: shortcut(qtbot, window, window.act_settings), run, SettingsDialog)
    assert results, "the settings dialog was not answered"
    return results


def test_settings_persist_and_the_token_goes_only_to_the_keychain(
    qtbot, qasync_loop, app_env, app_engine
):
    import keyring

    from app.core import secrets

    h = open_window(qtbot, app_env, app_engine)
    w = h.window

    def change(dialog) -> None:
        dialog.theme_combo.setCurrentIndex(dialog.theme_combo.findData("dark"))
        dialog.sampling.temperature.setValue(0.3)
        dialog.sampling.max_tokens.setValue(77)
        qtbot.keyClicks(dialog.system_prompt, "Default prompt")
        qtbot.keyClicks(dialog.token_edit, "hf_secret_token_123")
        click_button(qtbot, dialog, OK)
        return dialog.result() == dialog.DialogCode.Accepted and dialog.token_changed

    assert open_settings_and(qtbot, w, change) == [True]
    assert w.bridge.engine is app_engine  # model and pool unchanged: no engine restart
    assert w.settings.theme == "dark" and w.theme_actions["dark"].isChecked()
    shortcut(qtbot, w, w.act_new_chat)
    new_chat = w.focused_pane
    assert new_chat.session.settings.sampling.max_tokens == 77
    assert new_chat.session.settings.system_prompt == "Default prompt"
    h.close()

    assert keyring.get_password(secrets.SERVICE, secrets.HF_TOKEN_USER) == "hf_secret_token_123"
    keyring_file = Path(os.environ["XDG_DATA_HOME"]) / "python_keyring"
    assert keyring_file.exists()
    for f in app_env.iterdir():  # the app's own files never hold the token
        assert b"hf_secret_token_123" not in f.read_bytes()

    h2 = open_window(qtbot, app_env, app_engine)
    s = AppSettings.load(h2.store)
    assert s.theme == "dark" and s.default_sampling.max_tokens == 77
    assert s.default_sampling.temperature == pytest.approx(0.3)

    def look(dialog):
        shown = (dialog.token_edit.text(), dialog.theme_combo.currentData())
        click_button(qtbot, dialog, CANCEL)
        return shown

    assert open_settings_and(qtbot, h2.window, look) == [("hf_secret_token_123", "dark")]
    h2.window.theme_actions["light"].trigger()
    h2.close()


def test_invalid_settings_are_refused_with_a_message(qtbot, qasync_loop, app_env, app_engine,
                                                     tmp_path):
    """Bad values in the dialog keep it open with the reason; settings that arrive invalid
    anyway (e.g. from an older database) get a warning box, and nothing is saved."""
    h = open_window(qtbot, app_env, app_engine)
    w = h.window
    before = AppSettings.load(h.store).to_dict()

    def bad_repo(dialog):
        qtbot.mouseClick(dialog.kind_hf, Qt.MouseButton.LeftButton,
                         pos=dialog.kind_hf.rect().center())
        dialog.repo_edit.clear()
        qtbot.keyClicks(dialog.repo_edit, "not a repo")
        click_button(qtbot, dialog, OK)
        seen = (dialog.kind_hf.isChecked(), dialog.isVisible(), dialog.error.isVisible(),
                dialog.error.text())
        click_button(qtbot, dialog, CANCEL)
        return seen

    (checked, still_open, shown, text), = open_settings_and(qtbot, w, bad_repo)
    assert checked and still_open and shown and "owner/name" in text
    assert AppSettings.load(h.store).to_dict() == before

    invalid = AppSettings.from_dict(before)
    invalid.model_kind, invalid.model_folder = "folder", str(tmp_path / "gone")
    texts = []

    def warned(box) -> None:
        texts.append(box.text())
        box.button(QMessageBox.StandardButton.Ok).click()

    results = []
    answer_modal(qtbot, lambda: results.append(w.settings_flow.apply(invalid)), warned, QMessageBox)
    assert results == [False] and "does not exist" in texts[0]
    assert AppSettings.load(h.store).to_dict() == before and w.bridge.engine is app_engine
    h.close()


def test_a_model_folder_that_does_not_exist(qtbot, qasync_loop, app_env, app_engine, tmp_path):
    from app.bridges.engine_bridge import EngineBridge
    from app.core.store import Store
    from app.window.main_window import MainWindow
    from engine import EngineConfig

    # in the settings dialog: refused with a message, nothing changes
    h = open_window(qtbot, app_env, app_engine)
    pane = h.window.focused_pane
    pane.session.set_settings(greedy(6))
    type_and_send(qtbot, pane, "Say hi.")
    wait_idle(qtbot, pane)
    kept = [(m.id, m.content) for m in pane.session.active_path()]

    def choose_missing_folder(dialog):
        qtbot.mouseClick(dialog.kind_folder, Qt.MouseButton.LeftButton,
                         pos=dialog.kind_folder.rect().center())
        dialog.folder_edit.clear()
        qtbot.keyClicks(dialog.folder_edit, str(tmp_path / "no-such-model"))
        click_button(qtbot, dialog, OK)
        seen = (dialog.kind_folder.isChecked(), dialog.isVisible(), dialog.error.isVisible(),
                dialog.error.text())
        click_button(qtbot, dialog, CANCEL)
        return seen

    (checked, still_open, error_shown, error), = open_settings_and(
        qtbot, h.window, choose_missing_folder)
    assert checked and still_open and error_shown and "does not exist" in error
    assert h.window.settings.model_kind == "default"
    h.close()

    # given straight to the engine (as --model does): the engine's error shows in the window,
    # the chats are all there, and sending keeps the typed message with a clear notice
    store = Store(app_env)
    bridge = EngineBridge()
    window = MainWindow(store, bridge)
    qtbot.addWidget(window)
    window.show()
    bridge.start(EngineConfig(model=str(tmp_path / "no-such-model"), kv_memory_mib=16))
    qtbot.waitUntil(lambda: bridge.status == "error", timeout=60_000)
    assert window.banner.isVisible() and bridge.load_error
    assert "no-such-model" in window.banner.label.text()
    pane = window.focused_pane
    assert [(m.id, m.content) for m in pane.session.active_path()] == kept
    type_and_send(qtbot, pane, "Hello?")
    user, reply = pane.session.active_path()[-2:]
    assert user.content == "Hello?" and store.get_message(user.id).content == "Hello?"
    assert reply.status == Status.ERROR and pane.notice_label.isVisible()
    window.shutdown_chats()
    bridge.shutdown()
    store.close()


def test_changing_the_pool_restarts_the_engine_and_chats_survive(qtbot, qasync_loop, app_env):
    from app.bridges.engine_bridge import EngineBridge
    from app.core.app_settings import AppSettings
    from app.core.store import Store
    from app.window.main_window import MainWindow

    store = Store(app_env)
    settings = AppSettings(kv_memory_mib=24.0)
    bridge = EngineBridge()
    window = MainWindow(store, bridge, settings)
    qtbot.addWidget(window)
    window.show()
    bridge.start(settings.engine_config())
    qtbot.waitUntil(lambda: bridge.status == "ready", timeout=WAIT_MS)
    old_engine, old_info = bridge.engine, bridge.model_info
    pane = window.focused_pane
    pane.session.set_settings(greedy(6))
    pane.send("Say hi.")
    wait_idle(qtbot, pane)
    kept = [(m.id, m.content) for m in pane.session.active_path()]
    memory_before = mx.get_active_memory()  # one model and its pool (and other tests')

    def bigger_pool(dialog):
        dialog.kv_spin.setValue(48)
        dialog.block_combo.setCurrentIndex(dialog.block_combo.findData(32))
        click_button(qtbot, dialog, OK)
        return dialog.result() == dialog.DialogCode.Accepted

    assert open_settings_and(qtbot, window, bigger_pool) == [True]
    assert window.banner.loading.isVisible()  # loading again (in the status bar)
    qtbot.waitUntil(
        lambda: bridge.status == "ready" and bridge.engine is not old_engine, timeout=WAIT_MS
    )
    assert old_engine.status == "stopped"
    info = bridge.model_info
    assert old_info.block_size == 16 and info.block_size == 32
    old_pool = old_info.num_blocks * old_info.bytes_per_block
    new_pool = info.num_blocks * info.bytes_per_block
    assert new_pool > 1.5 * old_pool
    # One model in memory, not two: the stopped engine gave its weights and pool back at
    # once (the app's restart used to load the new model beside the old one until a
    # garbage collection happened to run), though this test still holds the old engine.
    assert mx.get_active_memory() < memory_before - old_pool + new_pool + 64 * 2**20
    assert old_engine.runtime is None
    assert [(m.id, m.content) for m in pane.session.active_path()] == kept
    assert AppSettings.load(store).block_size == 32
    type_and_send(qtbot, pane, "And again?")
    wait_idle(qtbot, pane)
    assert last_reply(pane).status in (Status.COMPLETE, Status.LENGTH)
    window.shutdown_chats()
    bridge.shutdown()
    store.close()
