"""Remote providers in the real window (offscreen Qt, the real engine, real loopback HTTP):
Settings ▸ Providers driven through its widgets, a pane picking a provider's model from its
header and streaming, stopping, regenerating with n, editing and branching there, errors shown
in the reply with the text kept, and send to all across local and remote panes while the
local engine batches the local ones. The API key must never reach the database, the settings,
the logs or any text shown."""

from __future__ import annotations

import logging
import os

import keyring
import pytest
from PySide6.QtCore import Qt

from app.core.providers import model_ref
from app.core.records import Status
from app.core.store import DB_NAME
from app.settings.dialog import SettingsDialog
from tests.app_helpers import WAIT_MS, greedy, last_reply, open_window, wait_idle
from tests.provider_servers import FaultServer

pytestmark = pytest.mark.model

KEY = "sk-app-test-7Hq2-secret"
NET_MS = 30000


@pytest.fixture(scope="module")
def faults():
    with FaultServer(api_key=KEY) as server:
        yield server


@pytest.fixture
def harness(qtbot, qasync_loop, app_env, app_engine, faults, caplog):
    caplog.set_level(logging.DEBUG)
    faults.release.clear()
    h = open_window(qtbot, app_env, app_engine)
    yield h
    h.close()
    # the key is in the keychain only: not in the database file, not in any log line
    blob = b"".join(f.read_bytes() for f in app_env.rglob("*") if f.is_file())
    assert (app_env / DB_NAME).exists() and KEY.encode() not in blob
    assert KEY not in caplog.text


def add_provider(h, faults, key=KEY):
    p = h.window.registry.add("Faults", faults.url, key=key)
    h.window.registry.set_models(p.id, ["echo", "held", "cut", "broken"])
    return p


def use_remote(qtbot, pane, ref: str) -> None:
    """Pick `ref` in the pane header's model selector with the keyboard, as a user would."""
    sel = pane.model_selector
    target = sel.findData(ref)
    assert target > 0, [sel.itemText(i) for i in range(sel.count())]
    sel.setFocus()
    while sel.currentIndex() != target:
        qtbot.keyClick(sel, Qt.Key.Key_Down)
    assert pane.session.model_ref == ref


def send(qtbot, pane, text: str) -> None:
    pane.input.setPlainText(text)
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)


def test_settings_providers_page_adds_tests_refreshes_and_removes(harness, qtbot, faults):
    w = harness.window
    dialog = SettingsDialog(w.settings, w, registry=w.registry)
    qtbot.addWidget(dialog)
    dialog.show()
    page = dialog.providers_page
    dialog.tabs.setCurrentWidget(page)
    qtbot.keyClicks(page.name_edit, "Team box")
    qtbot.keyClicks(page.url_edit, faults.url.removesuffix("/v1") + "/")
    qtbot.keyClicks(page.key_edit, KEY)
    qtbot.mouseClick(page.add_button, Qt.MouseButton.LeftButton)
    [p] = w.registry.providers()
    assert p.base_url == faults.url and keyring.get_password("PagedChat", p.key_user) == KEY
    qtbot.waitUntil(lambda: "lists 8 model(s)" in page.result_label.text(), timeout=NET_MS)
    assert "echo" in page.models_label.text() and "echo" in w.registry.get(p.id).models
    assert KEY not in page.key_edit.text() and "stored" in page.key_edit.placeholderText()
    # the pane header now offers the provider's models
    pane = w.focused_pane
    assert pane.model_selector.findData(model_ref(p.id, "echo")) > 0
    qtbot.mouseClick(page.test_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: page.result_label.text().startswith("✓"), timeout=NET_MS)
    assert "8 model(s)" in page.result_label.text()
    # a wrong key: the test says so, and never shows either key
    qtbot.keyClicks(page.key_edit, "sk-wrong")
    qtbot.mouseClick(page.save_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(page.test_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: page.result_label.text().startswith("✗"), timeout=NET_MS)
    assert "401" in page.result_label.text() and "sk-wrong" not in page.result_label.text()
    # bad input gets a message, nothing is added
    page.list.setCurrentRow(-1)
    page.url_edit.setText("gpu-box:8000")
    qtbot.mouseClick(page.add_button, Qt.MouseButton.LeftButton)
    assert "http://" in page.result_label.text() and len(w.registry.providers()) == 1
    page.list.setCurrentRow(0)
    qtbot.mouseClick(page.remove_button, Qt.MouseButton.LeftButton)
    assert w.registry.providers() == [] and page.list.count() == 0
    assert keyring.get_password("PagedChat", p.key_user) is None
    dialog.close()


def test_a_pane_on_a_remote_model_streams_regenerates_edits_and_branches(harness, qtbot, faults):
    w = harness.window
    p = add_provider(harness, faults)
    pane = w.focused_pane
    ref = model_ref(p.id, "echo")
    use_remote(qtbot, pane, ref)
    pane.session.set_settings(greedy(40, system="Answer briefly."))
    send(qtbot, pane, "hello remote world")
    assert pane.session.busy
    wait_idle(qtbot, pane)
    reply = last_reply(pane)
    assert (reply.content, reply.status) == ("hello remote world", Status.COMPLETE)
    assert reply.meta["usage"]["prompt_tokens"] == 7  # the server's own usage
    body = faults.requests[-1]
    assert body["messages"][0] == {"role": "system", "content": "Answer briefly."}
    assert body["temperature"] == 0.0 and body["max_tokens"] == 40
    # persisted per chat, shown in the pane header and the sidebar, and the footer says remote
    assert harness.store.get_conversation(pane.session.id).model == ref
    assert pane.model_label() == "echo @ Faults"
    assert "echo @ Faults" in w.sidebar.model.data(
        w.sidebar.model.index(0), Qt.ItemDataRole.ToolTipRole)
    assert "remote" in pane.footer.text()
    # regenerate with n = 2: one request, two more alternatives
    before = len(faults.requests)
    assert pane.regenerate(reply.id, n=2)
    wait_idle(qtbot, pane)
    assert len(faults.requests) == before + 1 and faults.requests[-1]["n"] == 2
    siblings = {m.content for m in pane.session.tree.children(reply.parent_id)}
    assert siblings == {"hello remote world", "hello#0 remote#0 world#0",
                        "hello#1 remote#1 world#1"}
    # edit the question: a new branch, the old one kept
    user_id = reply.parent_id
    assert pane.session.edit_and_resend(user_id, "edited words")
    wait_idle(qtbot, pane)
    assert last_reply(pane).content == "edited words"
    assert len(pane.session.tree.children(pane.session.tree.get(user_id).parent_id)) == 2
    # branch: the new chat talks to the same model
    new_pane = w.branch(pane.session, last_reply(pane).id)
    assert new_pane.session.model_ref == ref and new_pane.model_label() == "echo @ Faults"
    send(qtbot, new_pane, "branch reply")
    wait_idle(qtbot, new_pane)
    assert last_reply(new_pane).content == "branch reply"


def test_stop_closes_the_stream_and_errors_keep_the_text(harness, qtbot, faults):
    w = harness.window
    p = add_provider(harness, faults)
    pane = w.focused_pane
    use_remote(qtbot, pane, model_ref(p.id, "held"))
    faults.held_closed.clear()
    send(qtbot, pane, "first second third")
    qtbot.waitUntil(lambda: last_reply(pane).content == "first", timeout=NET_MS)
    qtbot.mouseClick(pane.send_button, Qt.MouseButton.LeftButton)  # it is the stop button now
    wait_idle(qtbot, pane)
    assert (last_reply(pane).content, last_reply(pane).status) == ("first", Status.STOPPED)
    assert faults.held_closed.wait(10), "stop did not close the HTTP stream"
    # a stream cut mid-reply: the words that came are kept, the reply says what happened
    use_remote(qtbot, pane, model_ref(p.id, "cut"))
    send(qtbot, pane, "alpha beta gamma delta")
    wait_idle(qtbot, pane)
    cut = last_reply(pane)
    assert cut.status == Status.ERROR and cut.content == "alpha beta"
    assert "mid-reply" in cut.meta["error"]
    stored = harness.store.get_message(cut.id)
    assert stored.content == "alpha beta" and stored.status == Status.ERROR
    shown = pane.model.entry(pane.model.row_of(cut.id)).doc.toPlainText()
    assert "alpha beta" in shown and "mid-reply" in shown  # the pane shows text and error
    # 500 and a refused key: named in the reply, the key never shown
    use_remote(qtbot, pane, model_ref(p.id, "broken"))
    send(qtbot, pane, "again")
    wait_idle(qtbot, pane)
    assert "500" in last_reply(pane).meta["error"]
    w.registry.update(p.id, p.name, p.base_url, key=KEY + "-old")
    send(qtbot, pane, "once more")
    wait_idle(qtbot, pane)
    error = last_reply(pane).meta["error"]
    assert "401" in error and KEY not in error
    texts = [m.meta.get("error", "") + m.content for m in harness.store.load_messages(
        pane.session.id)]
    values = [str(harness.store.get_value(k)) for k in ("providers", "app_settings",
                                                        "window_layout")]
    assert all(KEY not in t for t in texts + values)
    # switching back to the local model works in the same chat
    use_remote_local = pane.model_selector.findData("")
    pane.model_selector.setCurrentIndex(use_remote_local)
    pane.model_selector.activated.emit(use_remote_local)
    assert pane.session.model_ref == ""
    pane.session.set_settings(greedy(4))
    send(qtbot, pane, "Say yes.")
    wait_idle(qtbot, pane)
    assert last_reply(pane).status in (Status.COMPLETE, Status.LENGTH)
    assert last_reply(pane).content


def test_send_to_all_across_local_and_remote_panes(harness, qtbot, faults):
    w = harness.window
    p = add_provider(harness, faults)
    local_a = w.focused_pane
    local_a.session.set_settings(greedy(24))
    local_b = w.new_chat(new_pane=True)
    local_b.session.set_settings(greedy(24))
    remote = w.new_chat(new_pane=True)
    use_remote(qtbot, remote, model_ref(p.id, "held"))
    local_ids = {local_a.session.id, local_b.session.id}
    batched: list[set[str]] = []  # local chats running together while the remote streamed

    def on_snapshot(snap):
        if snap is None or not remote.session.busy or not last_reply(remote).content:
            return
        running = {sid for sid, s in snap.sessions.items()
                   if sid in local_ids and str(getattr(s.state, "value", s.state)) in (
                       "prefilling", "decoding")}
        batched.append(running)

    harness.bridge.snapshotUpdated.connect(on_snapshot)
    w.toggle_compare(True)
    w.compare_bar.input.setPlainText("Write a poem about rivers")
    qtbot.keyClick(w.compare_bar.input, Qt.Key.Key_Return)
    assert all(pn.session.busy for pn in (local_a, local_b, remote))
    # the remote pane streams its first word and holds; meanwhile both local chats decode
    qtbot.waitUntil(lambda: last_reply(remote).content == "Write", timeout=NET_MS)
    qtbot.waitUntil(lambda: all(last_reply(pn).content for pn in (local_a, local_b))
                    and local_ids in batched, timeout=WAIT_MS)
    assert remote.session.busy  # still streaming while the local ones produced text
    # the monitor lists the remote chat as "remote", holding no blocks
    rows = w.remote_sessions()
    assert rows[remote.session.id].state == "remote" and rows[remote.session.id].blocks_held == 0
    w.monitor_dock.show()
    legend = w.monitor_dock.widget().legend_model  # the monitor's chat table
    qtbot.waitUntil(lambda: legend.row_data(remote.session.id) is not None, timeout=NET_MS)
    row = legend.row_data(remote.session.id)
    assert (row.state, row.blocks) == ("remote", 0)
    state_cell = legend.data(legend.index(legend.row_of(remote.session.id), 1))
    assert state_cell == "remote"
    shot = os.environ.get("PAGEDCHAT_SCREENSHOT")
    if shot:
        w.grab().save(shot)
    faults.release.set()
    wait_idle(qtbot, local_a, local_b, remote)
    assert last_reply(remote).content == "Write a poem about rivers"
    assert all(last_reply(pn).status in (Status.COMPLETE, Status.LENGTH)
               for pn in (local_a, local_b))
    harness.bridge.snapshotUpdated.disconnect(on_snapshot)
