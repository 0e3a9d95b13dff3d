"""App logic that needs no model: store, message tree, markdown, throttle, no-display check."""

from __future__ import annotations

import sqlite3
import sys

import pytest

from app.chat.markdown import StreamingRenderer, render_markdown, stable_split
from app.core.records import ChatSettings, Message, Status
from app.core.store import Store
from app.core.tree import MessageTree
from app.display import no_display_problem
from app.theme import MARKDOWN_LIGHT
from engine import SamplingParams


def _msg(conv: str, mid: str, parent: str | None, role: str = "user", text: str = "x") -> Message:
    return Message(id=mid, conversation_id=conv, parent_id=parent, role=role, content=text)


def test_store_round_trip_and_wal(tmp_path):
    store = Store(tmp_path)
    conv = store.create_conversation(
        "Hello", ChatSettings("be brief", SamplingParams(temperature=0.2))
    )
    store.add_message(_msg(conv.id, "a", None, "user", "hi there"))
    store.add_message(_msg(conv.id, "b", "a", "assistant", "hello"))
    store.set_active_leaf(conv.id, "b")
    store.set_active_child("a", "b")
    store.close()
    mode = sqlite3.connect(tmp_path / "pagedchat.sqlite3").execute("PRAGMA journal_mode")
    assert mode.fetchone()[0] == "wal"
    store = Store(tmp_path)
    again = store.get_conversation(conv.id)
    assert again.settings.system_prompt == "be brief"
    assert again.settings.sampling.temperature == 0.2
    assert again.active_leaf == "b"
    msgs = store.load_messages(conv.id)
    assert [m.id for m in msgs] == ["a", "b"] and msgs[0].active_child == "b"
    assert store.search("THERE") == {conv.id}  # content, case-insensitive
    assert store.search("hel") == {conv.id}  # title
    assert store.search("100%") == set()  # LIKE wildcards are escaped
    store.delete_conversation(conv.id)
    assert store.load_messages(conv.id) == [] and store.get_conversation(conv.id) is None


def test_store_marks_streaming_replies_interrupted_at_open(tmp_path):
    store = Store(tmp_path)
    conv = store.create_conversation()
    store.add_message(_msg(conv.id, "u", None))
    reply = _msg(conv.id, "r", "u", "assistant", "partial te")
    reply.status = Status.STREAMING
    store.add_message(reply)
    store.close()
    store = Store(tmp_path)
    assert store.recovered_interrupted == 1
    (_, r) = store.load_messages(conv.id)
    assert r.status == Status.INTERRUPTED and r.content == "partial te"


def test_tree_alternatives_remember_their_branch():
    t = MessageTree()
    for m in (
        _msg("c", "u1", None),
        _msg("c", "a1", "u1", "assistant"),
        _msg("c", "u2", "a1"),
        _msg("c", "a2", "u2", "assistant"),
        _msg("c", "a1b", "u1", "assistant"),  # regenerated reply: sibling of a1
    ):
        t.add(m)
    t.activate("a2")
    assert [m.id for m in t.active_path()] == ["u1", "a1", "u2", "a2"]
    assert t.sibling_position("a1") == (0, 2)
    new, _ = t.switch("a1", +1)
    assert new == "a1b" and [m.id for m in t.active_path()] == ["u1", "a1b"]
    new, _ = t.switch("a1b", -1)  # back: the branch below a1 is restored
    assert [m.id for m in t.active_path()] == ["u1", "a1", "u2", "a2"]
    assert t.switch("a1", -1) == (None, [])


def test_markdown_code_blocks_and_half_written_text():
    r = render_markdown("Use this:\n\n```python\nprint('hi')\n```\n\nand `x`.", MARKDOWN_LIGHT)
    assert r.code_blocks == ("print('hi')",)
    assert 'href="copy:0"' in r.html and "<code" in r.html
    # an unclosed fence still renders its code, and the copy text is what was written so far
    half = render_markdown("```py\ndef f(:\n    return [", MARKDOWN_LIGHT)
    assert half.code_blocks == ("def f(:\n    return [",)
    # odd half-written constructs never raise and keep the text
    for text in ("**bold", "| a | b\n|--", "[link](http://", "1. one\n2.", "```", "> quote\n>"):
        out = render_markdown(text, MARKDOWN_LIGHT)
        assert out.html


def test_streaming_renderer_reparses_only_the_tail():
    s = StreamingRenderer(MARKDOWN_LIGHT)
    text = "First paragraph.\n\n```\ncode\n\nstill code\n```\n\nTail"
    cut = stable_split(text)
    assert text[cut:] == "Tail"  # the blank line inside the fence is not a cut point
    r = s.render(text)
    assert r.code_blocks == ("code\n\nstill code",)
    full = render_markdown(text, MARKDOWN_LIGHT)
    assert r.code_blocks == full.code_blocks


def test_no_display_message():
    assert no_display_problem({}, "linux").startswith("pagedchat: no display")
    msg = no_display_problem({}, "linux")
    assert "xvfb-run" in msg and "QT_QPA_PLATFORM=offscreen" in msg and "--screenshot" in msg
    assert "\n" not in msg
    assert no_display_problem({"DISPLAY": ":0"}, "linux") is None
    assert no_display_problem({"WAYLAND_DISPLAY": "w"}, "linux") is None
    assert no_display_problem({"QT_QPA_PLATFORM": "offscreen"}, "linux") is None
    assert no_display_problem({}, "darwin") is None


def test_pyside_refcount_leaks_cannot_exhaust_singletons(qapp):
    """PySide6 6.12 drops a reference to True per emit and to None per void call (on 3.11);
    app.qt_compat must make that harmless."""
    from PySide6.QtCore import QObject, Signal
    from PySide6.QtWidgets import QLabel

    import app  # noqa: F401  (applies the workaround)
    from app.qt_compat import leaked_references

    class Probe(QObject):
        ping = Signal(bool)

    p = Probe()
    label = QLabel()
    for _ in range(50_000):  # far more than the singletons' natural reference counts
        p.ping.emit(True)
        label.setText("x")
    assert sys.getrefcount(True) > 1_000_000 and sys.getrefcount(None) > 1_000_000
    assert set(leaked_references()) == {"None", "True", "False"}


def test_throttle_caps_render_rate(qapp, qtbot):
    from PySide6.QtCore import QElapsedTimer

    from app.chat.throttle import RenderThrottle

    throttle = RenderThrottle(hz=30)
    flushes = []

    class Client:
        def flush_render(self) -> None:
            flushes.append(1)

    clients = [Client() for _ in range(4)]
    clock = QElapsedTimer()
    clock.start()

    def pump() -> bool:
        for c in clients:  # tokens arriving continuously in four panes
            throttle.mark_dirty(c)
        return clock.elapsed() >= 1000

    qtbot.waitUntil(pump, timeout=5000)
    assert throttle.ticks <= 33  # about 30 Hz for all panes together
    assert len(flushes) <= 4 * 33


@pytest.mark.parametrize(
    "spec,kind",
    [("default", "default"), ("/no/such/dir", "folder"), ("mlx-community/Qwen3-0.6B-4bit", "hf")],
)
def test_model_spec_parsing(spec, kind):
    from app.core.app_settings import AppSettings

    s = AppSettings()
    s.set_model_spec(spec)
    assert s.model_kind == kind
    if kind == "folder":
        assert "does not exist" in s.validate()


def test_the_core_runs_without_qt():
    """What the import contract says statically, at run time too (a lazy import included)."""
    import subprocess
    from pathlib import Path

    code = (
        "import sys, pkgutil, importlib, app.core\n"
        "for m in pkgutil.iter_modules(app.core.__path__):\n"
        "    importlib.import_module('app.core.' + m.name)\n"
        "from app.core.store import Store\n"
        "from app.core.app_settings import AppSettings\n"
        "import tempfile\n"
        "s = Store(tempfile.mkdtemp())\n"
        "AppSettings().save(s); AppSettings.load(s).engine_config()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('PySide6', 'qasync'))))\n"
    )
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
