"""The chat app on the real engine and the real default model (offscreen Qt).

One engine per module (app_engine); each test builds a fresh main window on its own data folder.
Generations are short and greedy so the suite stays fast and deterministic.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from app.core.records import Message, Status
from tests.app_helpers import WAIT_MS, greedy, last_reply, open_window, wait_idle
from tests.reference import chat_prompt, greedy_reference, reference_model
from tests.user_path import alt_key, choose_from_context_menu, click_action, type_and_send

pytestmark = pytest.mark.model

LONG_PROMPT = "Write a long story about a dragon who learns to read."


@pytest.fixture
def harness(qtbot, qasync_loop, app_env, app_engine):
    h = open_window(qtbot, app_env, app_engine)
    yield h
    h.close()


def _pane_with(h, settings):
    pane = h.window.focused_pane
    pane.session.set_settings(settings)
    return pane


def greedy_text(messages: list[dict], max_tokens: int) -> str:
    """mlx-lm's own greedy reply to ``messages``, as text (computed while the engine idles)."""
    tokens = greedy_reference(chat_prompt(messages), max_tokens)
    return reference_model().tokenizer.decode(tokens)


def test_two_panes_stream_at_the_same_time(harness, qtbot):
    w = harness.window
    a = _pane_with(harness, greedy(24))
    b = w.new_chat(new_pane=True)
    b.session.set_settings(greedy(24))
    assert len(w.panes) == 2
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[str]] = {a.session.id: [], b.session.id: []}

    def on_token(session_id, request_id, index, text):
        first.setdefault(session_id, time.monotonic())
        tokens[session_id].append(request_id)

    harness.bridge.tokenReceived.connect(on_token)
    for pane in (a, b):
        pane.session.busyChanged.connect(
            lambda busy, sid=pane.session.id: (
                None if busy else done.setdefault(sid, time.monotonic())
            )
        )
    prompts = {a.session.id: LONG_PROMPT, b.session.id: "Write a long poem about the sea."}
    expected = {sid: greedy_text([{"role": "user", "content": text}], 24)
                for sid, text in prompts.items()}
    assert expected[a.session.id] != expected[b.session.id]
    streamed_wrong: list[str] = []

    def watch(pane):
        def changed(message_id: str) -> None:
            msg = pane.session.tree.get(message_id)
            if msg.role == "assistant" and not expected[pane.session.id].startswith(msg.content):
                streamed_wrong.append(f"{pane.session.id}: {msg.content!r}")
        pane.session.messageChanged.connect(changed)

    watch(a)
    watch(b)
    type_and_send(qtbot, a, prompts[a.session.id])
    qtbot.keyClick(w, Qt.Key.Key_2, Qt.KeyboardModifier.ControlModifier)
    assert w.focused_pane is b
    type_and_send(qtbot, b, prompts[b.session.id])
    assert a.session.busy and b.session.busy
    wait_idle(qtbot, a, b)
    # each pane received tokens before the other one finished: they streamed concurrently
    assert first[a.session.id] < done[b.session.id]
    assert first[b.session.id] < done[a.session.id]
    # every event carried its own chat's request id: no output landed in the wrong chat
    assert set(tokens[a.session.id]).isdisjoint(tokens[b.session.id])
    ra, rb = last_reply(a), last_reply(b)
    assert ra.role == rb.role == "assistant"
    # each pane got its own prompt's greedy reply, and showed only its prefixes while streaming
    assert ra.content == expected[a.session.id] and rb.content == expected[b.session.id]
    assert not streamed_wrong, streamed_wrong[:3]
    assert ra.status in (Status.COMPLETE, Status.LENGTH)
    # finished replies are persisted
    stored = {m.id: m for m in harness.store.load_messages(a.session.id)}
    assert stored[ra.id].content == ra.content and stored[ra.id].status == ra.status
    # the footer shows speed, context used / limit and blocks
    stats = a.footer_stats()
    assert stats["max_context"] == 8192 and stats["context"] and stats["context"] > 10
    assert "tok/s" in a.footer.text() and "/ 8,192 tokens" in a.footer.text()


def test_stop_ends_the_reply_and_frees_its_blocks(harness, qtbot):
    pane = _pane_with(harness, greedy(400))
    sid = pane.session.id
    pane.input.setPlainText(LONG_PROMPT)
    qtbot.mouseClick(pane.send_button, Qt.MouseButton.LeftButton)
    assert pane.session.busy and pane.send_button.accessibleName() == "Stop generating"

    def holds_blocks():
        snap = harness.bridge.latest_snapshot
        stats = snap.sessions.get(sid) if snap else None
        return bool(stats and stats.blocks_held > 0 and last_reply(pane).content)

    qtbot.waitUntil(holds_blocks, timeout=WAIT_MS)
    qtbot.mouseClick(pane.send_button, Qt.MouseButton.LeftButton)  # now the stop button
    wait_idle(qtbot, pane)
    reply = last_reply(pane)
    assert reply.status == Status.STOPPED and reply.content  # partial text kept
    qtbot.waitUntil(
        lambda: harness.bridge.latest_snapshot.sessions[sid].blocks_held == 0, timeout=10_000
    )
    assert harness.store.get_message(reply.id).status == Status.STOPPED


def test_regenerate_adds_alternatives_and_the_switcher_moves_between_them(harness, qtbot):
    pane = _pane_with(harness, greedy(8))
    type_and_send(qtbot, pane, "Name a colour.")
    wait_idle(qtbot, pane)
    original = last_reply(pane)
    kept = (original.id, original.content, original.status)  # values, not the live object
    assert original.content
    # the reply's own regenerate button: greedy, so the same text again, as a new sibling
    click_action(qtbot, pane, original.id, "regenerate")
    assert pane.session.busy
    wait_idle(qtbot, pane)
    again = last_reply(pane)
    assert again.id != original.id and again.content == kept[1]
    assert pane.session.tree.sibling_position(again.id) == (1, 2)
    # two more alternatives in one request (n=2) from the message's menu: sampled
    s = pane.session.settings
    s.sampling = dataclasses.replace(s.sampling, temperature=1.0, seed=7)
    pane.session.set_settings(s)
    choose_from_context_menu(pane, again.id, "Regenerate Alternatives", "2 Alternatives")
    assert pane.session.busy
    wait_idle(qtbot, pane)
    siblings = pane.session.tree.siblings(original.id)
    assert len(siblings) == 4 and all(
        m.status in (Status.COMPLETE, Status.LENGTH) and m.content for m in siblings
    )
    first = siblings[0]
    assert (first.id, first.content, first.status) == kept  # the old reply is kept as is
    stored = harness.store.get_message(kept[0])
    assert (stored.id, stored.content, stored.status) == kept
    shown = last_reply(pane)
    assert shown.id == siblings[2].id
    assert pane.session.tree.sibling_position(shown.id) == (2, 4)
    # click ‹ in the reply's switcher, then Alt+Left: back to the original
    click_action(qtbot, pane, shown.id, "prev")
    assert last_reply(pane).id == siblings[1].id
    alt_key(qtbot, pane, siblings[1].id, Qt.Key.Key_Left)
    assert last_reply(pane).id == original.id
    alt_key(qtbot, pane, original.id, Qt.Key.Key_Right)
    assert last_reply(pane).id == siblings[1].id
    click_action(qtbot, pane, siblings[1].id, "prev")
    assert last_reply(pane).id == original.id
    assert harness.store.get_conversation(pane.session.id).active_leaf == original.id


def test_edit_and_resend_makes_a_branch_and_keeps_the_old_one(harness, qtbot):
    pane = _pane_with(harness, greedy(8))
    pane.send("Say hello.")
    wait_idle(qtbot, pane)
    old_user, old_reply = pane.session.active_path()
    row = pane.model.row_of(old_user.id)
    edit = pane.view.row_geometry(row).actions["edit"]
    qtbot.mouseClick(pane.view.viewport(), Qt.MouseButton.LeftButton, pos=edit.center())
    assert pane.edit_banner.isVisible() and pane.input.toPlainText() == "Say hello."
    pane.input.setPlainText("Say goodbye.")
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)
    wait_idle(qtbot, pane)
    new_user, new_reply = pane.session.active_path()
    assert new_user.content == "Say goodbye." and new_user.id != old_user.id
    assert new_user.parent_id == old_user.parent_id is None  # a sibling: an alternative
    assert new_reply.content
    alt_key(qtbot, pane, new_user.id, Qt.Key.Key_Left)  # the user message's alternatives
    assert [m.id for m in pane.session.active_path()] == [old_user.id, old_reply.id]


def test_branch_from_a_message_opens_a_new_chat(harness, qtbot):
    w = harness.window
    pane = _pane_with(harness, greedy(8, system="You are terse."))
    pane.send("Count to three.")
    wait_idle(qtbot, pane)
    user, reply = pane.session.active_path()
    before = [(m.id, m.role, m.content, m.status) for m in (user, reply)]
    row = pane.model.row_of(reply.id)
    branch = pane.view.row_geometry(row).actions["branch"]
    qtbot.mouseClick(pane.view.viewport(), Qt.MouseButton.LeftButton, pos=branch.center())
    assert len(w.panes) == 2
    new = w.focused_pane
    assert new is not pane and new.session.id != pane.session.id
    copied = new.session.active_path()
    assert [(m.role, m.content) for m in copied] == [(m.role, m.content) for m in (user, reply)]
    assert new.session.settings.system_prompt == "You are terse."
    original = [(m.id, m.role, m.content, m.status) for m in pane.session.active_path()]
    assert original == before  # the original is untouched
    assert [m.id for m in copied] != [m.id for m in (user, reply)]  # copies, not the same rows
    type_and_send(qtbot, new, "And to four?")
    wait_idle(qtbot, new)
    assert len(new.session.active_path()) == 4 and len(pane.session.active_path()) == 2


def test_clicking_a_code_blocks_copy_link_copies_the_code(harness, qtbot):
    code = "def add(a, b):\n    return a + b"
    w = harness.window
    conv = harness.store.create_conversation("Code")
    harness.store.add_message(
        Message(id="q1", conversation_id=conv.id, parent_id=None, role="user", content="code?")
    )
    harness.store.add_message(
        Message(
            id="r1",
            conversation_id=conv.id,
            parent_id="q1",
            role="assistant",
            content=f"Here:\n\n```python\n{code}\n```\n\nDone.",
        )
    )
    pane = w.open_chat(conv.id)
    QGuiApplication.clipboard().clear()
    row = pane.model.row_of("r1")
    rect = pane.view.anchor_rect(row, "copy:0")
    assert rect is not None
    assert pane.view.anchor_at(rect.center()) == (row, "copy:0")
    with qtbot.waitSignal(pane.view.codeCopied, timeout=5000):
        qtbot.mouseClick(pane.view.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    assert QGuiApplication.clipboard().text() == code
    # a finished message is rendered once, however often it is painted
    renders = pane.model.full_renders
    for _ in range(5):
        pane.view.viewport().repaint()
    assert pane.model.full_renders == renders


def test_bad_input_shows_a_message_and_loses_nothing(harness, qtbot):
    pane = _pane_with(harness, greedy(8))
    before = len(pane.session.tree)
    pane.input.setPlainText("   ")
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)
    assert pane.notice_label.isVisible() and "Type a message" in pane.notice_label.text()
    assert len(pane.session.tree) == before and pane.input.toPlainText() == "   "
    # over the context limit: the engine refuses with a clear error, the prompt is kept
    huge = "hello " * 9000
    pane.input.setPlainText(huge)
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)
    wait_idle(qtbot, pane)
    user, reply = pane.session.active_path()
    assert user.content == huge and harness.store.get_message(user.id).content == huge
    assert reply.status == Status.ERROR and "context limit" in reply.meta["error"]
    # shown once (issue 11: it was also a notice), in the reply, as a capitalised sentence
    shown = pane.model.entry(pane.model.row_of(reply.id)).doc.toPlainText()
    assert shown.count("context limit") == 1 and "The prompt is" in shown, shown
    assert not (pane.notice_label.isVisible() and "context limit" in pane.notice_label.text())
    # the chat still works afterwards (edit the long message into a short one)
    click_action(qtbot, pane, user.id, "edit")
    assert pane.edit_banner.isVisible() and pane.input.toPlainText() == huge
    qtbot.keyClick(pane.input, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)
    qtbot.keyClicks(pane.input, "Hi!")
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)
    wait_idle(qtbot, pane)
    edited, reply = pane.session.active_path()
    assert edited.content == "Hi!" and edited.parent_id == user.parent_id
    assert reply.status in (Status.COMPLETE, Status.LENGTH)
    assert pane.session.tree.get(user.id).content == huge  # the long one is kept as a branch


def test_send_to_all_reaches_every_pane(harness, qtbot):
    w = harness.window
    panes = [_pane_with(harness, greedy(6))]
    for _ in range(2):
        p = w.new_chat(new_pane=True)
        p.session.set_settings(greedy(6))
        panes.append(p)
    assert not w.compare_bar.isVisible()
    qtbot.keyClick(w, Qt.Key.Key_Return,
                   Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    assert w.compare_bar.isVisible() and w.act_send_all.isChecked()
    qtbot.keyClicks(w.compare_bar.input, "Say yes.")
    qtbot.keyClick(w.compare_bar.input, Qt.Key.Key_Return)
    assert all(p.session.busy for p in panes)
    assert w.compare_bar.input.toPlainText() == ""
    wait_idle(qtbot, *panes)
    assert all(p.session.active_path()[0].content == "Say yes." for p in panes)
    # Ctrl+1..3 focus the panes
    qtbot.keyClick(w, Qt.Key.Key_2, Qt.KeyboardModifier.ControlModifier)
    assert w.focused_pane is panes[1]


def test_sending_while_the_chat_answers_shows_a_notice_and_keeps_the_text(harness, qtbot):
    pane = _pane_with(harness, greedy(300))
    type_and_send(qtbot, pane, LONG_PROMPT)
    assert pane.session.busy
    before = len(pane.session.tree)
    type_and_send(qtbot, pane, "And another thing")
    assert pane.notice_label.isVisible() and "still answering" in pane.notice_label.text()
    assert pane.input.toPlainText() == "And another thing"  # nothing typed is lost
    assert len(pane.session.tree) == before and pane.session.busy
    qtbot.keyClick(pane.input, Qt.Key.Key_Escape)  # Esc stops the reply
    wait_idle(qtbot, pane)
    assert last_reply(pane).status == Status.STOPPED
    pane.session.set_settings(greedy(6))  # a short reply this time
    qtbot.keyClick(pane.input, Qt.Key.Key_Return)  # now the kept text goes out
    assert pane.session.active_path()[-2].content == "And another thing"
    assert pane.input.toPlainText() == "" and not pane.notice_label.isVisible()
    wait_idle(qtbot, pane)


def test_deleting_a_streaming_chat_cancels_it_frees_its_blocks_and_removes_its_rows(
    harness, qtbot, app_engine
):
    from tests.user_path import delete_from_sidebar

    w = harness.window
    a = _pane_with(harness, greedy(400))
    b = w.new_chat(new_pane=True)
    b.session.set_settings(greedy(60))
    doomed, kept = a.session.id, b.session.id
    type_and_send(qtbot, a, LONG_PROMPT)
    qtbot.keyClick(w, Qt.Key.Key_2, Qt.KeyboardModifier.ControlModifier)
    type_and_send(qtbot, b, "Write a long poem about the sea.")

    def streaming(sid: str) -> bool:
        snap = app_engine.snapshot()
        return bool(snap and sid in snap.sessions and snap.sessions[sid].blocks_held)

    qtbot.waitUntil(lambda: streaming(doomed) and streaming(kept), timeout=WAIT_MS)
    assert harness.bridge.active_requests(doomed)
    delete_from_sidebar(qtbot, w, doomed, "Delete")
    assert harness.store.get_conversation(doomed) is None
    assert harness.store.load_messages(doomed) == [] and w.pane_for(doomed) is None
    assert [p.session.id for p in w.panes] == [kept]
    # its request ends (the engine's final event reaches the bridge) while the other streams
    qtbot.waitUntil(lambda: not harness.bridge.active_requests(doomed), timeout=WAIT_MS)
    assert harness.bridge.active_requests(kept)
    # the engine drops the chat before its next step (the other chat keeps it stepping)
    steps = app_engine.snapshot().counters.steps
    qtbot.waitUntil(lambda: app_engine.snapshot().counters.steps > steps, timeout=WAIT_MS)
    snap = app_engine.snapshot()
    assert doomed not in snap.sessions
    assert not any(doomed in owners for owners in snap.owners)
    wait_idle(qtbot, b)
    assert last_reply(b).status in (Status.COMPLETE, Status.LENGTH)
