"""The API server inside the desktop app: started from its menu, on the app's own engine,
streaming to API clients while the panes stream (offscreen Qt, the real default model)."""

from __future__ import annotations

import threading

import openai
import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from tests.app_helpers import WAIT_MS, greedy, last_reply, open_window, wait_idle

pytestmark = pytest.mark.model

SYSTEM = (
    "You are a careful assistant for a small bakery. Answer briefly, in plain words, and "
    "always mention that fresh bread is baked every morning at six o'clock."
)
PANE_PROMPT = "Write a long story about a baker who finds a map."


@pytest.fixture
def harness(qtbot, qasync_loop, app_env, app_engine):
    h = open_window(qtbot, app_env, app_engine)
    yield h
    h.close()


def test_api_clients_stream_while_the_panes_stream_on_one_engine(harness, qtbot) -> None:
    w, engine = harness.window, harness.bridge.engine
    panel = w.server_panel
    panel.settings.port = 0  # a free port (the dialog offers 1024-65535)
    server_menu = next(a.menu() for a in w.menuBar().actions() if a.text() == "&Server")
    assert panel.toggle in server_menu.actions()
    panel.toggle.trigger()  # Server > Run API Server
    qtbot.waitUntil(lambda: panel.running and bool(panel.url), timeout=WAIT_MS)
    assert panel.url.startswith("http://127.0.0.1:")
    assert panel.status.isVisible() and panel.url in panel.status.label.text()
    qtbot.mouseClick(panel.status.copy_key, Qt.MouseButton.LeftButton)
    key = QGuiApplication.clipboard().text()
    assert key and key == panel._key

    pane = w.focused_pane
    pane.session.set_settings(greedy(48, system=SYSTEM))
    qtbot.keyClicks(pane.input, PANE_PROMPT)
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: bool(last_reply(pane).content), timeout=WAIT_MS)  # prompt cached

    client = openai.OpenAI(base_url=panel.url, api_key=key, timeout=WAIT_MS / 1000,
                           max_retries=0)
    requests = {
        "same-as-pane": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": PANE_PROMPT}],
        "same-system": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Which bread is best for toast?"}],
    }
    results: dict[str, tuple[str, object]] = {}
    errors: list[BaseException] = []
    both_streaming = threading.Event()

    def api_client(name: str) -> None:
        try:
            parts, usage = [], None
            for chunk in client.chat.completions.create(
                    model=engine.model_info.name, messages=requests[name], temperature=0,
                    max_tokens=48, stream=True, stream_options={"include_usage": True},
                    user=name):
                parts.extend(c.delta.content or "" for c in chunk.choices)
                usage = chunk.usage or usage
                snap = engine.snapshot()
                states = {sid: s.state for sid, s in snap.sessions.items() if s.requests}
                if pane.session.id in states and f"API · {name}" in states:
                    both_streaming.set()
            results[name] = ("".join(parts), usage)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=api_client, args=(n,), daemon=True) for n in requests]
    for t in threads:
        t.start()
    qtbot.waitUntil(lambda: len(results) + len(errors) == len(requests), timeout=WAIT_MS)
    wait_idle(qtbot, pane)
    assert not errors, errors
    assert both_streaming.is_set(), "the API requests never ran alongside the pane's reply"

    # One engine: the API reply to the pane's own conversation is the pane's reply, and
    # both API requests reused the chat's prompt blocks from the shared prefix cache.
    assert results["same-as-pane"][0] == last_reply(pane).content
    bs = engine.model_info.block_size
    system_blocks = len(engine.encode_chat([{"role": "system", "content": SYSTEM}],
                                           add_generation_prompt=False)) // bs
    for name in requests:
        cached = results[name][1].prompt_tokens_details.cached_tokens
        assert cached >= (system_blocks - 1) * bs > 0, (name, cached)

    panel.toggle.trigger()  # Server > Run API Server, unchecked: stops it
    qtbot.waitUntil(lambda: not panel.running and not panel.toggle.isChecked(), timeout=WAIT_MS)
    with pytest.raises(openai.APIConnectionError):
        client.with_options(timeout=10).models.list()


def test_server_settings_persist_and_start_at_launch(harness, qtbot, app_env) -> None:
    from app.window.server_panel import ServerSettings

    ServerSettings(port=0, start_at_launch=True).save(harness.store)
    from tests.app_helpers import open_window as reopen

    second = reopen(qtbot, app_env, harness.bridge.engine)
    try:
        panel = second.window.server_panel
        assert panel.settings == ServerSettings(port=0, start_at_launch=True)
        qtbot.waitUntil(lambda: panel.running, timeout=WAIT_MS)
        assert panel.toggle.isChecked()
    finally:
        second.close()
    assert not panel.running
