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

import pytest

from app.core.app_settings import AppSettings
from app.core.records import Status
from tests.app_helpers import WAIT_MS, greedy, last_reply, open_window, wait_idle

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parent.parent


def test_round_trip_across_a_window_restart(qtbot, qasync_loop, app_env, app_engine):
    h = open_window(qtbot, app_env, app_engine)
    w = h.window
    a = w.focused_pane
    a.session.set_settings(greedy(8, system="Answer in one word."))
    a.send("Name a fruit.")
    wait_idle(qtbot, a)
    first = last_reply(a)
    s = a.session.settings
    s.sampling = dataclasses.replace(s.sampling, temperature=1.0, seed=3)
    a.session.set_settings(s)
    a.regenerate(first.id)
    wait_idle(qtbot, a)
    assert a.session.switch_alternative(last_reply(a).id, -1)  # show the first reply again
    b = w.new_chat(new_pane=True)
    b.session.set_settings(greedy(6))
    b.send("Say hi.")
    wait_idle(qtbot, b)
    b.session.rename("Greetings")
    w.act_monitor.trigger()  # hide the KV monitor dock
    w.toggle_sidebar(False)
    assert not w.monitor_dock.isVisible()
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
    w2.toggle_sidebar(True)
    assert w2.sidebar.visible_ids()[:2] and set(ids) <= set(w2.sidebar.visible_ids())
    w2.sidebar.set_search("Greet")
    assert w2.sidebar.visible_ids() == [b.session.id]
    w2.sidebar.set_search("fruit")  # message content is searched too
    assert w2.sidebar.visible_ids() == [a.session.id]
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
    assert pane2.regenerate(reply.id)
    wait_idle(qtbot, pane2)
    assert len(pane2.session.tree.siblings(reply_id)) == 2
    assert last_reply(pane2).status in (Status.COMPLETE, Status.LENGTH)
    h2.close()


def test_killed_mid_reply_loses_at_most_about_a_second(qtbot, qasync_loop, app_env, app_engine):
    """A real crash: the app process is SIGKILLed while three replies stream."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.main", "--demo", "--data-dir", str(app_env)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    db = app_env / "pagedchat.sqlite3"

    def streamed() -> str | None:
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
            row = con.execute(
                "SELECT content FROM messages WHERE status='streaming' AND length(content) > 20"
            ).fetchone()
            con.close()
            return row[0] if row else None
        except sqlite3.Error:
            return None

    try:
        deadline = time.monotonic() + WAIT_MS / 1000
        while streamed() is None:
            assert proc.poll() is None, "the app exited before streaming"
            assert time.monotonic() < deadline, "no reply was saved while streaming"
            time.sleep(0.05)
        saved_at = time.monotonic()
        partial = streamed()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert time.monotonic() - saved_at < 5
    h = open_window(qtbot, app_env, app_engine)
    replies = [
        m
        for s in h.window.manager.sessions.values()
        for m in s.tree.by_id.values()
        if m.role == "assistant"
    ]
    interrupted = [m for m in replies if m.status == Status.INTERRUPTED]
    assert interrupted and any(m.content.startswith(partial) for m in interrupted)
    pane = h.window.pane_for(interrupted[0].conversation_id)
    assert pane is not None and last_reply(pane).status == Status.INTERRUPTED
    h.close()


def test_settings_persist_and_the_token_goes_only_to_the_keychain(
    qtbot, qasync_loop, app_env, app_engine
):
    import keyring

    from app.core import secrets
    from app.settings_dialog import SettingsDialog

    h = open_window(qtbot, app_env, app_engine)
    w = h.window
    dialog = SettingsDialog(w.settings, w)
    qtbot.addWidget(dialog)
    dialog.theme_combo.setCurrentIndex(dialog.theme_combo.findData("dark"))
    dialog.sampling.temperature.setValue(0.3)
    dialog.sampling.max_tokens.setValue(77)
    dialog.system_prompt.setPlainText("Default prompt")
    dialog.token_edit.setText("hf_secret_token_123")
    dialog.accept()
    assert dialog.result() == dialog.DialogCode.Accepted and dialog.token_changed
    assert w.apply_settings(dialog.value(), dialog.token_changed)
    assert w.bridge.engine is app_engine  # model and pool unchanged: no engine restart
    new_chat = w.new_chat()
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
    dialog = SettingsDialog(h2.window.settings, h2.window)
    qtbot.addWidget(dialog)
    assert dialog.token_edit.text() == "hf_secret_token_123"
    assert dialog.theme_combo.currentData() == "dark"
    h2.window.set_theme("light")
    h2.close()


def test_a_model_folder_that_does_not_exist(qtbot, qasync_loop, app_env, app_engine, tmp_path):
    from app.core.store import Store
    from app.engine_bridge import EngineBridge
    from app.main_window import MainWindow
    from app.settings_dialog import SettingsDialog
    from engine import EngineConfig

    # in the settings dialog: refused with a message, nothing changes
    h = open_window(qtbot, app_env, app_engine)
    pane = h.window.focused_pane
    pane.session.set_settings(greedy(6))
    pane.send("Say hi.")
    wait_idle(qtbot, pane)
    kept = [(m.id, m.content) for m in pane.session.active_path()]
    dialog = SettingsDialog(h.window.settings, h.window)
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.kind_folder.setChecked(True)
    dialog.folder_edit.setText(str(tmp_path / "no-such-model"))
    dialog.accept()
    assert dialog.result() != dialog.DialogCode.Accepted
    assert dialog.error.isVisible() and "does not exist" in dialog.error.text()
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
    pane.input.setPlainText("Hello?")
    pane._submit(pane.input.toPlainText())
    user, reply = pane.session.active_path()[-2:]
    assert user.content == "Hello?" and store.get_message(user.id).content == "Hello?"
    assert reply.status == Status.ERROR and pane.notice_label.isVisible()
    window.shutdown_chats()
    bridge.shutdown()
    store.close()


def test_changing_the_pool_restarts_the_engine_and_chats_survive(qtbot, qasync_loop, app_env):
    from app.core.app_settings import AppSettings
    from app.core.store import Store
    from app.engine_bridge import EngineBridge
    from app.main_window import MainWindow

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

    new = AppSettings.from_dict(settings.to_dict())
    new.kv_memory_mib = 48.0
    new.block_size = 32
    assert window.apply_settings(new)
    assert window.banner.isVisible()  # loading again
    qtbot.waitUntil(
        lambda: bridge.status == "ready" and bridge.engine is not old_engine, timeout=WAIT_MS
    )
    assert old_engine.status == "stopped"
    info = bridge.model_info
    assert old_info.block_size == 16 and info.block_size == 32
    assert (
        info.num_blocks * info.bytes_per_block
        > 1.5 * old_info.num_blocks * old_info.bytes_per_block
    )
    assert [(m.id, m.content) for m in pane.session.active_path()] == kept
    assert AppSettings.load(store).block_size == 32
    pane.send("And again?")
    wait_idle(qtbot, pane)
    assert last_reply(pane).status in (Status.COMPLETE, Status.LENGTH)
    window.shutdown_chats()
    bridge.shutdown()
    store.close()
