"""Per-chat settings: the system prompt and the sampling parameters.

Values are checked with the engine's own SamplingParams validation before the dialog closes,
so a bad value is reported here, in words, instead of failing at the next send.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.core.records import ChatSettings, SamplingSettings


class SamplingForm(QWidget):
    """The sampling fields (shared by this dialog and the app settings' defaults)."""

    def __init__(self, sampling: SamplingSettings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)

        def dspin(name: str, lo: float, hi: float, step: float, value: float, dec: int = 2):
            w = QDoubleSpinBox()
            w.setRange(lo, hi)
            w.setSingleStep(step)
            w.setDecimals(dec)
            w.setValue(value)
            w.setAccessibleName(name)
            return w

        def ispin(name: str, lo: int, hi: int, value: int):
            w = QSpinBox()
            w.setRange(lo, hi)
            w.setValue(value)
            w.setAccessibleName(name)
            return w

        self.temperature = dspin("Temperature", 0.0, 2.0, 0.05, sampling.temperature)
        self.temperature.setToolTip("0 is greedy (deterministic); higher is more varied.")
        self.top_p = dspin("Top P", 0.01, 1.0, 0.05, sampling.top_p)
        self.top_k = ispin("Top K", 0, 1000, sampling.top_k)
        self.top_k.setSpecialValueText("off")
        self.min_p = dspin("Min P", 0.0, 0.99, 0.01, sampling.min_p)
        self.repetition_penalty = dspin(
            "Repetition penalty", 0.5, 2.0, 0.05, sampling.repetition_penalty
        )
        self.max_tokens = ispin("Maximum reply tokens", 1, 32768, sampling.max_tokens)
        self.seed = ispin("Seed", -1, 2**31 - 1, -1 if sampling.seed is None else sampling.seed)
        self.seed.setSpecialValueText("random")
        form.addRow("&Temperature:", self.temperature)
        form.addRow("Top &P:", self.top_p)
        form.addRow("Top &K:", self.top_k)
        form.addRow("&Min P:", self.min_p)
        form.addRow("&Repetition penalty:", self.repetition_penalty)
        form.addRow("Max reply &tokens:", self.max_tokens)
        form.addRow("S&eed:", self.seed)

    def value(self) -> SamplingSettings:
        return SamplingSettings(
            temperature=self.temperature.value(),
            top_p=self.top_p.value(),
            top_k=self.top_k.value(),
            min_p=self.min_p.value(),
            repetition_penalty=self.repetition_penalty.value(),
            max_tokens=self.max_tokens.value(),
            seed=None if self.seed.value() < 0 else self.seed.value(),
        )


def sampling_error(sampling: SamplingSettings) -> str | None:
    """The engine's own complaint about these values, or None."""
    from engine import SamplingParams

    try:
        SamplingParams(**sampling.to_dict())
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


class ChatSettingsDialog(QDialog):
    def __init__(self, title: str, settings: ChatSettings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Chat Settings — {title}")
        self.setAccessibleName("Chat settings")
        self.setMinimumWidth(440)
        layout = QVBoxLayout(self)
        label = QLabel("&System prompt:")
        self.system_prompt = QPlainTextEdit(settings.system_prompt)
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setPlaceholderText("e.g. You are a concise assistant.")
        self.system_prompt.setTabChangesFocus(True)
        self.system_prompt.setFixedHeight(110)
        label.setBuddy(self.system_prompt)
        layout.addWidget(label)
        layout.addWidget(self.system_prompt)
        self.sampling = SamplingForm(settings.sampling)
        layout.addWidget(self.sampling)
        self.error = QLabel()
        self.error.setObjectName("errorLabel")
        self.error.setWordWrap(True)
        self.error.hide()
        layout.addWidget(self.error)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def value(self) -> ChatSettings:
        return ChatSettings(
            system_prompt=self.system_prompt.toPlainText(), sampling=self.sampling.value()
        )

    def accept(self) -> None:
        problem = sampling_error(self.sampling.value())
        if problem:
            self.error.setText(problem)
            self.error.show()
            return
        super().accept()
