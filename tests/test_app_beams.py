""""Best of k (beam search)" in a chat's settings (docs/ARCHITECTURE.md §6.1), offscreen Qt.

The form's box, what it does to the sampling boxes, what is stored, and a chat that answers
with the best beam of the real engine, compared with the reference beam search on mlx-lm's
own cache.
"""

from __future__ import annotations

import dataclasses

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialogButtonBox

from app.chat.chat_settings_dialog import ChatSettingsDialog
from app.core.records import ChatSettings, Status
from app.core.session_logic import reply_params
from engine import SamplingParams
from tests.app_helpers import last_reply, open_window, wait_idle
from tests.reference import chat_prompt, reference_beam_search, reference_model
from tests.user_path import answer_modal, click_button, type_and_send


def _type_into(qtbot, box, text: str) -> None:
    box.setFocus()
    box.selectAll()
    qtbot.keyClicks(box, text)
    box.interpretText()


def test_best_of_k_holds_the_sampling_boxes_neutral_and_gives_them_back(qtbot) -> None:
    sampling = SamplingParams(temperature=0.6, top_p=0.9, top_k=30, min_p=0.05,
                              repetition_penalty=1.2, seed=5, max_tokens=100)
    dialog = ChatSettingsDialog("A chat", ChatSettings("", sampling))
    qtbot.addWidget(dialog)
    dialog.show()
    form = dialog.sampling
    beams = form.beam_width
    assert beams.accessibleName() == "Best of k (beam search)"
    assert (beams.minimum(), beams.maximum(), beams.text()) == (1, 8, "off")
    _type_into(qtbot, beams, "3")
    held = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
    assert not any(form.widgets[name].isEnabled() for name in held)
    assert form.max_tokens.isEnabled()
    assert dialog.problem() is None  # the engine takes what the boxes now hold
    assert dialog.value().sampling == SamplingParams(temperature=0.0, beam_width=3,
                                                     max_tokens=100)
    _type_into(qtbot, beams, "1")  # off again: the user's values come back
    assert beams.text() == "off"
    assert all(form.widgets[name].isEnabled() for name in held)
    assert dialog.value().sampling == sampling


def test_beam_settings_are_stored_and_loaded_like_the_others() -> None:
    settings = ChatSettings("", SamplingParams(temperature=0.0, beam_width=4, length_penalty=0.5,
                                               early_stopping="never"))
    assert ChatSettings.from_dict(settings.to_dict()) == settings
    early = ChatSettings("", SamplingParams(temperature=0.0, beam_width=2, early_stopping=True))
    assert ChatSettings.from_dict(early.to_dict()).sampling.early_stopping is True
    # a stored value the engine refuses keeps the default, as for every other field
    loaded = ChatSettings.from_dict({"sampling": {"early_stopping": 1, "beam_width": 12}})
    assert (loaded.sampling.early_stopping, loaded.sampling.beam_width) == (False, 1)


def test_alternatives_of_a_beam_search_chat_are_its_best_beams() -> None:
    chat = SamplingParams(temperature=0.0, beam_width=3)
    assert reply_params(chat, 1) == dataclasses.replace(chat, n=1)
    assert reply_params(chat, 2) == dataclasses.replace(chat, n=2)
    assert reply_params(chat, 5) == dataclasses.replace(chat, n=5, beam_width=5)
    sampled = SamplingParams(temperature=0.7)
    assert reply_params(sampled, 4) == dataclasses.replace(sampled, n=4)


@pytest.mark.model
def test_a_chat_set_to_best_of_three_shows_the_best_beam(qtbot, qasync_loop, app_env,
                                                         app_engine) -> None:
    harness = open_window(qtbot, app_env, app_engine)
    try:
        pane = harness.window.focused_pane
        pane.session.set_settings(ChatSettings("", SamplingParams(temperature=0.7,
                                                                  max_tokens=16)))

        def choose_beams(dialog) -> None:
            try:
                _type_into(qtbot, dialog.sampling.beam_width, "3")
                click_button(qtbot, dialog, QDialogButtonBox.StandardButton.Ok)
            finally:
                if dialog.isVisible():
                    dialog.reject()

        answer_modal(qtbot, lambda: qtbot.mouseClick(pane.settings_button,
                                                     Qt.MouseButton.LeftButton),
                     choose_beams, ChatSettingsDialog)
        sampling = pane.session.settings.sampling
        assert (sampling.beam_width, sampling.temperature) == (3, 0.0)
        stored = harness.store.get_conversation(pane.session.id).settings
        assert stored.sampling == sampling  # persisted with the chat
        question = "What is the capital of France?"
        type_and_send(qtbot, pane, question)
        wait_idle(qtbot, pane)
        reply = last_reply(pane)
        best, _ = reference_beam_search(
            chat_prompt([{"role": "user", "content": question}]),
            dataclasses.replace(sampling, n=1))[0]
        tokenizer = reference_model().tokenizer
        text = tokenizer.decode([t for t in best if t not in tokenizer.eos_token_ids])
        assert reply.status in (Status.COMPLETE, Status.LENGTH)
        assert reply.content == text
    finally:
        harness.close()
