"""One story (issue 25, item 5): the same new-chat defaults in both settings dialogs, one name
for the model everywhere, chats told apart by titles the model writes after the first reply
(a user's rename wins), and "waiting" in the monitor for a chat whose request is queued.

Real dialogs opened by their shortcuts and buttons, real keys; titles checked against
mlx-lm's own greedy answer to the same title request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialogButtonBox

from app.bridges.engine_bridge import EngineBridge
from app.core.app_settings import AppSettings
from app.core.generation_defaults import FALLBACK, describe, model_defaults
from app.core.model_names import model_id
from app.core.session_logic import clean_title, title_prompt
from app.core.store import Store
from app.monitor.legend import STATE
from app.window.main_window import MainWindow
from engine import DEFAULT_MODEL_NAME, EngineStatus, SamplingParams, SequenceState, SessionStats
from tests.app_helpers import WAIT_MS, engineless_window, greedy, open_window, wait_idle
from tests.reference import chat_prompt, greedy_reference, reference_model
from tests.user_path import answer_modal, click_button, rename_by_keys, shortcut, type_and_send

# ---- one set of defaults -------------------------------------------------------------------


def test_both_settings_dialogs_show_what_new_chats_start_with(qtbot, qasync_loop, app_env):
    store = Store(app_env)
    with engineless_window(qtbot, store) as w:
        expected, _source = model_defaults("")  # no model loaded: PagedChat's own
        assert expected == FALLBACK
        seen: dict[str, object] = {}

        def read_settings(dialog) -> None:
            dialog.tabs.setCurrentIndex(1)  # New Chats
            seen["settings"] = dialog.sampling.value()
            note = getattr(dialog, "defaults_source_label", None)  # read, then always close
            seen["note"] = note.text() if note is not None else ""
            click_button(qtbot, dialog, QDialogButtonBox.StandardButton.Ok)

        answer_modal(qtbot, lambda: shortcut(qtbot, w, w.act_settings), read_settings)
        assert seen["settings"] == expected, "the New Chats page shows other defaults"
        assert "PagedChat's defaults" in seen["note"]
        # saved unchanged: new chats keep following the model (a model loaded later wins)
        assert AppSettings.load(store).default_sampling == SamplingParams()

        def read_chat(dialog) -> None:
            seen["chat"] = dialog.sampling.value()
            seen["line"] = dialog.defaults_label.text()
            click_button(qtbot, dialog, QDialogButtonBox.StandardButton.Cancel)

        pane = w.focused_pane
        answer_modal(qtbot, lambda: qtbot.mouseClick(pane.settings_button,
                                                     Qt.MouseButton.LeftButton), read_chat)
        assert seen["chat"] == expected and describe(expected) in seen["line"]

        # a value the user types becomes theirs, for the next new chat too
        def set_temperature(dialog) -> None:
            dialog.tabs.setCurrentIndex(1)
            spin = dialog.sampling.temperature
            spin.setFocus()
            spin.selectAll()
            qtbot.keyClicks(spin, "0.55")
            click_button(qtbot, dialog, QDialogButtonBox.StandardButton.Ok)

        answer_modal(qtbot, lambda: shortcut(qtbot, w, w.act_settings), set_temperature)
        mine = dataclasses.replace(FALLBACK, temperature=0.55)
        assert AppSettings.load(store).default_sampling == mine
        assert w.new_chat(new_pane=True).session.settings.sampling == mine


# ---- the monitor: a queued request is "waiting" --------------------------------------------


class _Handle:
    """A request the engine has not taken in: no event until it is cancelled."""

    def __init__(self, request_id: str, session_id: str) -> None:
        self.request_id, self.session_id = request_id, session_id
        self._cancelled = asyncio.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    async def stream(self):
        await self._cancelled.wait()
        return
        yield


class BusyEngine:
    """An engine inside one long step (a big prompt chunk on a slow CPU): its inbox is not
    read and its last snapshot, published before the request, stays the latest."""

    status = EngineStatus.READY
    load_error = None

    def __init__(self, real, snapshot) -> None:
        self.model_info = real.model_info
        self._real, self._snapshot = real, snapshot
        self._ids = itertools.count()
        self.handles: list[_Handle] = []

    def wait_ready(self, timeout=None) -> bool:
        return True

    def snapshot(self):
        return self._snapshot

    def submit(self, messages=None, params=None, session_id="", **_kw) -> _Handle:
        handle = _Handle(f"queued-{next(self._ids)}", session_id)
        self.handles.append(handle)
        return handle

    def count_tokens(self, messages) -> int:
        return self._real.count_tokens(messages)

    def cancel_session(self, session_id: str) -> None:
        for h in self.handles:
            if h.session_id == session_id:
                h.cancel()


@pytest.mark.model
def test_the_monitor_shows_a_queued_chat_as_waiting(qtbot, qasync_loop, app_env, app_engine):
    store = Store(app_env)
    busy = BusyEngine(app_engine, app_engine.snapshot())
    bridge = EngineBridge(engine=busy)
    w = MainWindow(store, bridge, AppSettings.load(store))
    qtbot.addWidget(w)
    w.show()
    try:
        qtbot.waitUntil(lambda: bridge.status == EngineStatus.READY, timeout=WAIT_MS)
        pane = w.focused_pane
        sid = pane.session.id
        # the engine knows this chat from an earlier reply: "finished", as telemetry says
        old = busy.snapshot()
        finished = SessionStats(sid, SequenceState.FINISHED, 0, 0, 0, 0, 0.0, 0)
        busy._snapshot = dataclasses.replace(old, sessions={**old.sessions, sid: finished})
        legend = w.monitor_dock.widget().legend_model
        qtbot.waitUntil(lambda: legend.row_data(sid) is not None, timeout=10_000)
        assert legend.index(legend.row_of(sid), STATE).data() == "idle"
        type_and_send(qtbot, pane, "Hello?")
        assert pane.session.busy
        qtbot.waitUntil(lambda: legend.row_data(sid).state == "waiting", timeout=10_000)
        assert legend.index(legend.row_of(sid), STATE).data() == "waiting"
        # the engine takes it in: its newer snapshot's state wins
        prefilling = dataclasses.replace(finished, state=SequenceState.PREFILLING, requests=1)
        busy._snapshot = dataclasses.replace(
            old, time=time.time() + 1, sessions={**old.sessions, sid: prefilling})
        qtbot.waitUntil(lambda: legend.row_data(sid).state == "prefilling", timeout=10_000)
    finally:
        w.shutdown_chats()
        w.close()
        bridge.shutdown()
        store.close()


# ---- on the real model: one name, titles -----------------------------------------------------


@pytest.fixture
def harness(qtbot, qasync_loop, app_env, app_engine):
    h = open_window(qtbot, app_env, app_engine)
    yield h
    h.close()


def model_title(user: str, reply: str) -> str | None:
    """The title mlx-lm's own greedy generation gives for the titler's request."""
    from app.chat.titler import MAX_TITLE_TOKENS

    tokens = greedy_reference(chat_prompt(title_prompt(user, reply)), MAX_TITLE_TOKENS)
    return clean_title(reference_model().tokenizer.decode(tokens, skip_special_tokens=True))


@pytest.mark.model
def test_one_name_for_the_model_everywhere(harness, qtbot):
    w = harness.window
    name = model_id(harness.bridge.model_info.name)
    assert name == DEFAULT_MODEL_NAME and " " not in name  # also the API's id (test_server)
    assert w.model_button.text() == name
    assert w.focused_pane.model_label() == f"Local · {name}"
    shortcut(qtbot, w, w.act_models)
    table = w.models_window.installed
    names = [table.cells(m)[0] for m in table.models]
    assert name in names
    built_in = table.models[names.index(name)]
    held = harness.bridge.model_info.name[len(name):].strip(" ()")  # "fp32" or "4-bit"
    kv = harness.bridge.model_info.kv_dtype  # the KV precision it runs with (issue #26)
    kv = "8-bit (int8)" if kv == "int8" else kv
    assert built_in.quantization.endswith(f"runs as {held}, K/V {kv}")
    assert f"weights: {held}" in w.model_button.toolTip()
    w.models_window.close()


@pytest.mark.model
def test_the_model_titles_a_chat_after_its_first_reply(harness, qtbot):
    pane = harness.window.focused_pane
    pane.session.set_settings(greedy(12))
    type_and_send(qtbot, pane, "What is the capital of France?")
    assert pane.session.title == "What is the capital of France?"
    wait_idle(qtbot, pane)
    user, reply = pane.session.active_path()
    expected = model_title(user.content, reply.content)
    assert expected and expected != user.content
    qtbot.waitUntil(lambda: pane.session.title == expected, timeout=WAIT_MS)
    assert harness.store.get_conversation(pane.session.id).title == expected
    assert pane.title_label.toolTip() == expected
    # the title request is gone from the monitor once done
    qtbot.waitUntil(lambda: not harness.window.titler.running, timeout=WAIT_MS)


@pytest.mark.model
def test_quitting_while_a_title_is_written_leaves_no_error(qtbot, qasync_loop, app_env,
                                                           app_engine):
    """The window shuts down while the model writes a title: the title's answer (its
    cancelled final) arrives after the store is closed and must be ignored (CI caught
    "Cannot operate on a closed database" raised in the event loop by the titler)."""
    h = open_window(qtbot, app_env, app_engine)
    w = h.window
    pane = w.focused_pane
    pane.session.set_settings(greedy(12))
    type_and_send(qtbot, pane, "Name three rivers.")
    wait_idle(qtbot, pane)
    qtbot.waitUntil(lambda: bool(w.titler.running), timeout=WAIT_MS)  # asked the model
    [title_request] = w.titler.running
    finals: list[str] = []
    h.bridge.finalReceived.connect(lambda _s, rid, _i, _e: finals.append(rid))
    w.shutdown_chats()
    w.close()
    h.store.close()
    qtbot.waitUntil(lambda: title_request in finals, timeout=WAIT_MS)  # delivered after
    assert not w.titler.running
    h.bridge.shutdown()


@pytest.mark.model
def test_a_rename_by_the_user_wins_over_the_generated_title(harness, qtbot):
    w = harness.window
    pane = w.focused_pane
    pane.session.set_settings(greedy(12))
    type_and_send(qtbot, pane, "Name three colours.")
    wait_idle(qtbot, pane)
    qtbot.waitUntil(lambda: bool(w.titler.running), timeout=WAIT_MS)  # asked the model
    rename_by_keys(qtbot, w, "My colours")
    qtbot.waitUntil(lambda: not w.titler.running, timeout=WAIT_MS)  # its answer came back
    assert pane.session.title == "My colours"
    assert harness.store.get_conversation(pane.session.id).title == "My colours"


@pytest.mark.model
def test_chats_with_the_same_first_message_are_told_apart(harness, qtbot):
    w = harness.window
    first = w.focused_pane
    first.session.set_settings(greedy(12))
    second = w.new_chat(new_pane=True)
    second.session.set_settings(greedy(12))
    question = "What is the capital of Italy?"
    qtbot.keyClicks(second.input, question)
    qtbot.keyClick(second.input, Qt.Key.Key_Return,
                   Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    titles = {first.session.title, second.session.title}
    assert titles == {question, f"{question} 2"}
    wait_idle(qtbot, first, second)
    user, reply = first.session.active_path()
    expected = model_title(user.content, reply.content)
    assert second.session.active_path()[1].content == reply.content  # greedy: the same reply
    qtbot.waitUntil(
        lambda: {first.session.title, second.session.title} == {expected, f"{expected} 2"},
        timeout=WAIT_MS)
    shown = {w.sidebar.model.index(r, 0).data() for r in range(w.sidebar.model.rowCount())}
    assert {expected, f"{expected} 2"} <= shown
