"""Per-chat settings: the system prompt and the sampling parameters.

Values are checked with the engine's own SamplingParams validation before the dialog closes,
so a bad value is reported here, in words, instead of failing at the next send.
"""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QWidget

from app.core.generation_defaults import describe
from app.core.records import ChatSettings
from app.settings.forms import ChatSettingsForm, CheckedDialog
from engine import SamplingParams


class ChatSettingsDialog(CheckedDialog):
    def __init__(
        self,
        title: str,
        settings: ChatSettings,
        parent: QWidget | None = None,
        defaults: SamplingParams | None = None,
        defaults_source: str = "",
    ) -> None:
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
        self.defaults_label = QLabel()
        self.defaults_label.setObjectName("defaultsNote")
        self.defaults_label.setWordWrap(True)
        self.defaults_label.setAccessibleName("New chat defaults")
        if defaults is not None:
            self.defaults_label.setText(
                f"New chats start with {describe(defaults)}"
                + (f", from {defaults_source}." if defaults_source else ".")
            )
            self.body.addWidget(self.defaults_label)

    def value(self) -> ChatSettings:
        return self.form.value()

    def problem(self) -> str | None:
        return self.sampling.error()
