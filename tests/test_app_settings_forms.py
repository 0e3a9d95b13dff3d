"""Settings are the engine's own dataclasses: stored as JSON, loaded forgivingly, edited in forms
built from their fields, and judged by the engine's rules."""

from __future__ import annotations

import dataclasses

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox

from app.core.app_settings import AppSettings
from app.core.records import ChatSettings
from app.settings.forms import NOT_IN_FORM, SAMPLING_UI
from engine import EngineConfig, SamplingParams


def test_every_sampling_field_is_in_the_form_or_named_as_left_out():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(SAMPLING_UI) <= names, "the form shows a field the engine does not have"
    assert names - set(SAMPLING_UI) == NOT_IN_FORM


def test_stored_sampling_keeps_defaults_for_what_the_engine_refuses():
    loaded = ChatSettings.from_dict(
        {
            "system_prompt": 3,  # not text: the default
            "sampling": {
                "temperature": -1,  # the engine refuses a negative temperature
                "top_p": 0,  # and a top_p outside (0, 1]
                "top_k": "12",  # text that is a number is fine
                "max_tokens": "lots",
                "seed": "",  # an empty seed is "random"
                "stop": ["\n\n"],
                "no_such_field": 1,
            },
        }
    )
    default = SamplingParams()
    assert loaded.system_prompt == ""
    assert loaded.sampling == dataclasses.replace(default, top_k=12, stop=("\n\n",))


def test_app_settings_load_what_the_previous_version_stored():
    stored = {  # the shape app_settings.py wrote before it stored the engine's dataclass
        "model_kind": "hf",
        "model_folder": "",
        "model_repo": "mlx-community/Qwen3-0.6B-4bit",
        "kv_memory_mib": 128.0,
        "block_size": 32,
        "theme": "dark",
        "default_system_prompt": "Be brief.",
        "default_sampling": {
            "temperature": 0.3,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "max_tokens": 200,
            "seed": 5,
        },
    }
    s = AppSettings.from_dict(stored)
    assert s.model_spec() == "mlx-community/Qwen3-0.6B-4bit" and s.theme == "dark"
    assert (s.kv_memory_mib, s.block_size) == (128.0, 32)
    assert s.default_sampling == SamplingParams(
        temperature=0.3, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        max_tokens=200, seed=5,
    )
    assert AppSettings.from_dict(s.to_dict()) == s


def test_pool_settings_are_judged_by_the_engine_config():
    good = AppSettings(block_size=8)
    assert good.validate() is None
    assert good.engine_config() == EngineConfig(model="default", kv_memory_mib=256.0, block_size=8,
                                                kv_precision="model")
    bad = AppSettings(block_size=12)
    with pytest.raises(ValueError) as refused:
        EngineConfig(block_size=12)
    assert str(refused.value) in bad.validate()
    # a stored block size the engine does not support falls back to the default
    assert AppSettings.from_dict({"block_size": 12}).block_size == AppSettings().block_size


def _type_into(qtbot, box, text: str) -> None:
    box.setFocus()
    box.selectAll()
    qtbot.keyClicks(box, text)
    box.interpretText()


def test_chat_settings_dialog_takes_what_the_user_types(qtbot):
    from app.chat.chat_settings_dialog import ChatSettingsDialog

    dialog = ChatSettingsDialog("A chat", ChatSettings("old prompt", SamplingParams(seed=4)))
    qtbot.addWidget(dialog)
    dialog.show()
    form = dialog.sampling
    assert form.seed.value() == 4 and form.temperature.value() == pytest.approx(0.7)
    dialog.system_prompt.selectAll()
    qtbot.keyClicks(dialog.system_prompt, "You are terse.")
    typed = {
        "temperature": "1.25", "top_p": "0.8", "top_k": "20", "min_p": "0.1",
        "repetition_penalty": "1.15", "max_tokens": "64",
    }
    for name, text in typed.items():
        _type_into(qtbot, form.widgets[name], text)
    _type_into(qtbot, form.seed, "-1")  # the lowest value reads "random": no seed
    assert form.seed.text() == "random"
    ok = dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok)
    qtbot.mouseClick(ok, Qt.MouseButton.LeftButton)
    assert dialog.result() == QDialog.DialogCode.Accepted
    assert dialog.value() == ChatSettings(
        "You are terse.",
        SamplingParams(
            temperature=1.25, top_p=0.8, top_k=20, min_p=0.1, repetition_penalty=1.15,
            max_tokens=64, seed=None,
        ),
    )


def test_the_user_chooses_the_kv_precision_in_settings(qtbot):
    """Settings > KV cache pool: Automatic / 16-bit / 8-bit (issue #26), kept, handed to the
    engine, and a restart when it changes; a stored value the engine does not know falls back
    to the model's own precision (the default: 8-bit greedy replies are not yet the 16-bit
    ones often enough, bench/results/kv8.md)."""
    from PySide6.QtCore import Qt

    from app.settings.dialog import SettingsDialog

    assert AppSettings().kv_precision == "model"
    dialog = SettingsDialog(AppSettings())
    qtbot.addWidget(dialog)
    dialog.show()
    combo = dialog.precision_combo
    assert [combo.itemText(i) for i in range(combo.count())] == [
        "Automatic", "16-bit (the model's own)", "8-bit"]
    assert combo.currentData() == "model"
    assert "twice the tokens" in dialog.precision_hint.text()
    combo.setFocus()
    qtbot.keyClick(combo, Qt.Key.Key_End)  # the last choice, as a keyboard user picks it
    chosen = dialog.value()
    assert chosen.kv_precision == "int8"
    assert chosen.engine_config().kv_precision == "int8"
    assert chosen.engine_key() != AppSettings().engine_key()  # the engine restarts
    assert AppSettings.from_dict(chosen.to_dict()).kv_precision == "int8"
    assert AppSettings.from_dict({"kv_precision": "4-bit"}).kv_precision == "model"


def test_the_precision_hint_says_what_8_bit_buys_for_the_loaded_model(qtbot):
    """From the engine's own figures for the loaded model (bytes per block at each
    precision), at the budget being typed."""
    from app.settings.dialog import SettingsDialog
    from engine.events import ModelInfo

    info = ModelInfo(name="SmolLM2-135M-Instruct", model_type="llama", max_context=8192,
                     block_size=16, num_blocks=364, bytes_per_block=737280,
                     attention="reference", kv_dtype="float32", full_bytes_per_block=737280,
                     int8_bytes_per_block=190080)
    dialog = SettingsDialog(AppSettings(), model_info=info)
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.kv_spin.setValue(512)
    t16 = (512 * 2**20 // 737280) * 16
    t8 = (512 * 2**20 // 190080) * 16
    text = dialog.precision_hint.text()
    assert f"{t16:,} tokens at the model's own precision, {t8:,} at 8-bit" in text
    assert f"about {(t8 - t16) // 16:,} more tokens per chat with 16 chats" in text
