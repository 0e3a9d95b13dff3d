"""App logic that needs no model: store, message tree, markdown, throttle, no-display check."""

from __future__ import annotations

import html
import re
import sqlite3
import sys

import pytest

from app.chat.markdown import StreamingRenderer, render_markdown, stable_split
from app.core.records import ChatSettings, Message, Status
from app.core.store import Store
from app.core.tree import MessageTree
from app.ui.display import no_display_problem
from app.ui.theme import MARKDOWN_LIGHT
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
    # odd half-written constructs never raise and keep the text (every word stays visible)
    for text in ("**bold", "| a | b\n|--", "[link](http://", "1. one\n2.", "```", "> quote\n>"):
        out = render_markdown(text, MARKDOWN_LIGHT)
        assert out.html
        visible = html.unescape(re.sub(r"<[^>]+>", " ", out.html)).split()
        for word in re.findall(r"[A-Za-z]+", text):
            assert any(word in v for v in visible), f"{word!r} of {text!r} is lost"


def test_streaming_renderer_reparses_only_the_tail(monkeypatch):
    import app.chat.markdown as md

    text = "First paragraph.\n\n```\ncode\n\nstill code\n```\n\nSecond paragraph.\n\nTail"
    cut = stable_split(text)
    assert text[cut:] == "Tail"  # the blank line inside the fence is not a cut point
    parsed: list[str] = []
    real = md.render_markdown

    def counting(source, *args, **kwargs):
        parsed.append(source)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(md, "render_markdown", counting)
    s = StreamingRenderer(MARKDOWN_LIGHT)
    steps = [text[:n] for n in range(4, len(text) + 1, 3)] + [text]  # tokens arriving
    for partial in steps:
        before = len(parsed)
        r = s.render(partial)
        done = stable_split(partial)
        # each call parses the open tail, plus the finished prefix only when it grew
        assert parsed[-1] == partial[done:]
        assert parsed[before:-1] in ([], [partial[:done]])
    assert s.renders == len(steps)
    prefixes = [p for p in parsed if p and text.startswith(p) and p == text[:stable_split(p)]]
    assert len(prefixes) == len(set(prefixes)) == 3  # each finished block parsed once
    assert sum(map(len, parsed)) < len(steps) * len(text) / 3  # far less than full reparses
    monkeypatch.setattr(md, "render_markdown", real)
    full = render_markdown(text, MARKDOWN_LIGHT)
    assert r.code_blocks == full.code_blocks == ("code\n\nstill code",)
    assert r.html == full.html


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
    app.ui.qt_compat must make that harmless."""
    from PySide6.QtCore import QObject, Signal
    from PySide6.QtWidgets import QLabel

    import app  # noqa: F401  (applies the workaround)
    from app.ui.qt_compat import leaked_references

    class Probe(QObject):
        ping = Signal(bool)

    p = Probe()
    label = QLabel()
    for _ in range(50_000):  # far more than the singletons' natural reference counts
        p.ping.emit(True)
        label.setText("x")
    assert sys.getrefcount(True) > 1_000_000 and sys.getrefcount(None) > 1_000_000
    assert set(leaked_references()) == {"None", "True", "False"}


def test_throttle_renders_about_30_times_a_second_on_a_controlled_clock(qapp, monkeypatch):
    import app.chat.throttle as throttle_module
    from tests.manual_clock import ManualClock

    clock = ManualClock()
    monkeypatch.setattr(throttle_module, "QTimer", clock.timer_class())
    throttle = throttle_module.RenderThrottle(hz=30)
    flushes: list[tuple[int, int]] = []  # (time, client)

    class Client:
        def __init__(self, n: int) -> None:
            self.n = n

        def flush_render(self) -> None:
            flushes.append((clock.now, self.n))

    clients = [Client(n) for n in range(4)]
    clock.advance(500)  # nothing dirty: no renders
    assert throttle.ticks == 0 and not flushes
    for _ in range(1000):  # a token every millisecond in each of four panes, for one second
        for c in clients:
            throttle.mark_dirty(c)
        clock.advance(1)
    # 1000 ms at a 33 ms interval: 30 renders, no more (cap) and no fewer (it does render)
    assert 29 <= throttle.ticks <= 31
    times = sorted({t for t, _ in flushes})
    assert len(times) == throttle.ticks
    assert all(b - a >= 33 for a, b in zip(times, times[1:]))  # never faster than 30 Hz
    # every tick renders each dirty pane exactly once
    assert sorted(flushes) == sorted((t, c.n) for t in times for c in clients)
    # the last tokens are on screen within one interval, then the throttle goes quiet
    stopped = clock.now
    clock.advance(33)
    assert max(t for t, _ in flushes) - stopped <= 33
    ticks = throttle.ticks
    clock.advance(1000)
    assert throttle.ticks == ticks


def test_throttle_flushes_on_the_real_qt_timer(qapp, qtbot):
    from app.chat.throttle import RenderThrottle

    throttle = RenderThrottle(hz=30)
    flushed = []

    class Client:
        def flush_render(self) -> None:
            flushed.append(1)

    throttle.mark_dirty(Client())
    assert not flushed  # deferred to the timer, not rendered per token
    qtbot.waitUntil(lambda: flushed == [1], timeout=5000)


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


def test_new_chat_defaults_come_from_the_models_generation_config(tmp_path):
    """Item 8 (issue 11): a model folder's generation_config.json sets new chats' sampling;
    values the engine would refuse, or no file at all, leave PagedChat's own defaults."""
    import json

    from app.core.generation_defaults import FALLBACK, FROM_APP, FROM_MODEL, model_defaults

    folder = tmp_path / "model"
    folder.mkdir()
    assert model_defaults(folder) == (FALLBACK, FROM_APP)  # no file
    assert model_defaults(None) == (FALLBACK, FROM_APP)
    (folder / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1,
        "max_new_tokens": 256, "bos_token_id": 1, "eos_token_id": 2,
    }))
    params, source = model_defaults(folder)
    assert source == FROM_MODEL
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    assert (params.repetition_penalty, params.max_tokens) == (1.1, 256)
    # greedy when the model says so; a value out of range keeps ours
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "top_p": 7, "temperature": "hot"})
    )
    params, source = model_defaults(folder)
    assert source == FROM_MODEL and params.temperature == 0.0
    assert params.top_p == FALLBACK.top_p
    # a broken file is no model setting
    (folder / "generation_config.json").write_text("{not json")
    assert model_defaults(folder) == (FALLBACK, FROM_APP)


def test_a_models_title_is_cleaned_and_a_sentence_refused():
    """What the titler keeps of the model's answer (app/chat/titler.py): the first line
    without marks, labels, quotes or a final stop; an answer longer than a title is a
    sentence the model wrote instead of a title (the default model does so for about half of
    20 first exchanges), and the chat keeps its first message's title rather than a cut one."""
    from app.core.session_logic import TITLE_LENGTH, clean_title

    assert clean_title('Title: "Paris, the capital."\nmore') == "Paris, the capital"
    assert clean_title("1. Boil an egg") == "Boil an egg"
    assert clean_title("**The  Solar System**") == "The Solar System"
    assert clean_title("   \n  ") is None
    assert clean_title("...") is None
    sentence = "A KV cache is a type of cache that stores and reuses the keys of attention"
    assert len(sentence) > TITLE_LENGTH and clean_title(sentence) is None
    exact = "x" * TITLE_LENGTH
    assert clean_title(exact) == exact
