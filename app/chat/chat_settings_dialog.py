"""Per-chat settings: the system prompt and the sampling parameters.

Values are checked with the engine's own SamplingParams validation before the dialog closes,
so a bad value is reported here, in words, instead of failing at the next send.
"""

from __future__ import annotations

from PySide6.QtWidgets import QWidget

from app.core.records import ChatSettings
from app.forms import ChatSettingsForm, CheckedDialog


class ChatSettingsDialog(CheckedDialog):
    def __init__(self, title: str, settings: ChatSettings, parent: QWidget | None = None) -> None:
        super().__init__(f"Chat Settings — {title}", "Chat settings", 440, parent)
        self.form = ChatSettingsForm(
            settings,
            "&System prompt:",
            "System prompt",
            110,
            placeholder="e.g. You are a concise assistant.",
        )
        self.system_prompt = self.form.system_prompt
        self.sampling = self.form.sampling
        self.body.addWidget(self.form)

    def value(self) -> ChatSettings:
        return self.form.value()

    def problem(self) -> str | None:
        return self.sampling.error()
