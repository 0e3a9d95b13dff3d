"""What both settings dialogs are made of: a chat-settings form and a dialog that checks first.

The sampling form is built from the engine's SamplingParams fields, with only the look of each
field (label, range, step) kept here, keyed by field name: a field the engine adds shows up
by adding one line to SAMPLING_UI, and a value is valid exactly when the engine accepts it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import get_args, get_type_hints

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import (
    QAbstractSpinBox,
    QCheckBox,
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

from app.core.records import ChatSettings
from engine import SamplingParams


@dataclass(frozen=True)
class FieldUI:
    """How one numeric field is shown: `label` has the mnemonic, `name` is for screen readers.

    An optional field (`int | None`) shows None as `low`, with `special` as its text.
    """

    label: str
    name: str
    low: float
    high: float
    step: float = 1.0
    decimals: int = 2
    special: str = ""
    tip: str = ""


SAMPLING_UI: dict[str, FieldUI] = {
    "temperature": FieldUI(
        "&Temperature:", "Temperature", 0.0, 2.0, 0.05,
        tip="0 is greedy (deterministic); higher is more varied.",
    ),
    "top_p": FieldUI("Top &P:", "Top P", 0.01, 1.0, 0.05),
    "top_k": FieldUI("Top &K:", "Top K", 0, 1000, special="off"),
    "min_p": FieldUI("&Min P:", "Min P", 0.0, 0.99, 0.01),
    "repetition_penalty": FieldUI(
        "&Repetition penalty:", "Repetition penalty", 0.5, 2.0, 0.05
    ),
    "repetition_context_size": FieldUI(
        "Repetition &window:", "Repetition window in tokens", 1, 4096,
        tip="How many of the latest tokens the repetition penalty looks at; a window "
            "shorter than a sentence lets the model repeat that sentence.",
    ),
    "max_tokens": FieldUI("Max reply &tokens:", "Maximum reply tokens", 1, 32768),
    "seed": FieldUI("S&eed:", "Seed", -1, 2**31 - 1, special="random"),
    "beam_width": FieldUI(
        "&Best of k (beam search):", "Best of k (beam search)", 1, 8, special="off",
        tip="Search this many replies side by side and show the most likely one (the "
            "model's own probabilities, greedy): slower, and the reply appears only when "
            "the search ends. Off (1) samples as set above.",
    ),
}
# Per request, not per chat: `n` is how many alternatives a regenerate asks for, stop
# strings are not offered in the app, and a grammar (`constraint`) and `logprobs` are what an
# API request or a tool call asks for, not a chat's setting. A beam search's length penalty
# and early stopping keep the engine's defaults (Hugging Face's) in the app.
NOT_IN_FORM = frozenset({"n", "stop", "constraint", "logprobs", "length_penalty",
                         "early_stopping"})
#: What beam search ranks by is the model's own distribution: these boxes are set to their
#: neutral values (the engine refuses any other with beam search) and disabled while "Best of
#: k" is on, and get the user's values back when it is turned off.
BEAM_NEUTRAL: dict[str, object] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                   "repetition_penalty": 1.0, "seed": None}


class SamplingForm(QWidget):
    """A spin box for every SamplingParams field in SAMPLING_UI; `value()` keeps the rest."""

    def __init__(self, sampling: SamplingParams, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._base = sampling
        self._optional: set[str] = set()
        self.widgets: dict[str, QAbstractSpinBox] = {}
        form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)
        hints = get_type_hints(SamplingParams)
        for f in dataclasses.fields(SamplingParams):
            ui = SAMPLING_UI.get(f.name)
            if ui is None:
                continue
            kind = hints[f.name]
            if type(None) in get_args(kind):
                self._optional.add(f.name)
                (kind,) = [a for a in get_args(kind) if a is not type(None)]
            w = _spin_box(kind, ui)
            value = getattr(sampling, f.name)
            w.setValue(ui.low if value is None else value)
            self.widgets[f.name] = w
            form.addRow(ui.label, w)
        #: the user's sampling values, kept while beam search holds them neutral
        self._sampled: dict[str, object] | None = None
        beams = self.widgets.get("beam_width")
        if beams is not None:
            self._hold_for_beams(beams.value() > 1)
            beams.valueChanged.connect(lambda k: self._hold_for_beams(k > 1))

    def _hold_for_beams(self, on: bool) -> None:
        """Beam search on: the sampling boxes show their neutral values, disabled (the
        user's are kept); off: the user's values come back."""
        boxes = {name: w for name, w in self.widgets.items() if name in BEAM_NEUTRAL}
        if on and self._sampled is None:
            self._sampled = {name: w.value() for name, w in boxes.items()}
            for name, w in boxes.items():
                neutral = BEAM_NEUTRAL[name]
                w.setValue(w.minimum() if neutral is None else neutral)
        elif not on and self._sampled is not None:
            for name, w in boxes.items():
                w.setValue(self._sampled[name])
            self._sampled = None
        for w in boxes.values():
            w.setEnabled(not on)

    def __getattr__(self, name: str) -> QAbstractSpinBox:
        """A field's spin box by the field's name (form.temperature), for code that names one."""
        widgets = self.__dict__.get("widgets", {})
        if name in widgets:
            return widgets[name]
        raise AttributeError(name)

    def values(self) -> dict[str, object]:
        """What the boxes hold, by field name (None for an optional box at its special value)."""
        out: dict[str, object] = {}
        for name, w in self.widgets.items():
            v = w.value()
            out[name] = None if name in self._optional and v <= w.minimum() else v
        return out

    def value(self) -> SamplingParams:
        """The edited SamplingParams (raises ValueError when the engine refuses the values)."""
        return dataclasses.replace(self._base, **self.values())

    def error(self) -> str | None:
        """The engine's own complaint about the values in the boxes, or None."""
        try:
            self.value()
        except (TypeError, ValueError) as exc:
            return str(exc)
        return None


def _spin_box(kind: type, ui: FieldUI) -> QAbstractSpinBox:
    w: QAbstractSpinBox
    if kind is float:
        w = QDoubleSpinBox()
        w.setDecimals(ui.decimals)
        w.setSingleStep(ui.step)
    else:
        w = QSpinBox()
    w.setRange(ui.low, ui.high)  # type: ignore[attr-defined]
    w.setAccessibleName(ui.name)
    if ui.special:
        w.setSpecialValueText(ui.special)
    if ui.tip:
        w.setToolTip(ui.tip)
    return w


class ChatSettingsForm(QWidget):
    """A system prompt box above the sampling form: a chat's settings, or the defaults."""

    def __init__(
        self,
        settings: ChatSettings,
        label: str,
        accessible_name: str,
        height: int,
        placeholder: str = "",
        parent: QWidget | None = None,
        with_tools: bool = True,
    ) -> None:
        super().__init__(parent)
        v = QVBoxLayout(self)
        v.setContentsMargins(0, 0, 0, 0)
        caption = QLabel(label)
        self.system_prompt = QPlainTextEdit(settings.system_prompt)
        self.system_prompt.setAccessibleName(accessible_name)
        self.system_prompt.setPlaceholderText(placeholder)
        self.system_prompt.setTabChangesFocus(True)
        self.system_prompt.setFixedHeight(height)
        caption.setBuddy(self.system_prompt)
        v.addWidget(caption)
        v.addWidget(self.system_prompt)
        self.prompt_hint = QLabel("Enter adds a line · Ctrl+Enter saves")
        self.prompt_hint.setObjectName("hint")
        v.addWidget(self.prompt_hint)
        self.system_prompt.installEventFilter(self)
        self.sampling = SamplingForm(settings.sampling)
        v.addWidget(self.sampling)
        # MCP tools (Settings ▸ Tools): a folder's settings carry them to its new chats
        self.tools_check = QCheckBox("Use &tools (the MCP servers of Settings ▸ Tools)")
        self.tools_check.setAccessibleName("Use MCP tools")
        self.tools_check.setChecked(settings.tools)
        self.tools_first = QCheckBox("Call a tool &first (for models that never call on"
                                     " their own)")
        self.tools_first.setAccessibleName("Call a tool first")
        self.tools_first.setToolTip("The first reply to each message is held to a valid tool"
                                    " call (a grammar); the reply after the result is free.")
        self.tools_first.setChecked(settings.tool_choice == "required")
        self.tools_first.setEnabled(settings.tools)
        self.tools_check.toggled.connect(self.tools_first.setEnabled)
        if with_tools:  # the app-wide defaults keep no tool choice: the tools stay off
            v.addWidget(self.tools_check)
            v.addWidget(self.tools_first)
        else:
            self.tools_check.hide()
            self.tools_first.hide()

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        """Ctrl/⌘+Enter in the prompt box accepts the dialog (Enter itself adds a line)."""
        if (
            obj is self.system_prompt
            and event.type() == QEvent.Type.KeyPress
            and event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
            and event.modifiers()
            & (Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.MetaModifier)
            and isinstance(self.window(), QDialog)
        ):
            self.window().accept()
            return True
        return super().eventFilter(obj, event)

    def value(self) -> ChatSettings:
        """The edited settings (raises ValueError when the engine refuses the sampling)."""
        return ChatSettings(
            system_prompt=self.system_prompt.toPlainText(), sampling=self.sampling.value(),
            tools=self.tools_check.isChecked(),
            tool_choice="required" if self.tools_first.isChecked() else "auto",
        )


class CheckedDialog(QDialog):
    """Content above an error line and OK/Cancel; OK closes only when `problem()` is None.

    Subclasses put their content in `self.body` and say what is wrong in `problem()`.
    """

    def __init__(
        self, title: str, accessible_name: str, min_width: int, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle(title)
        self.setAccessibleName(accessible_name)
        self.setMinimumWidth(min_width)
        layout = QVBoxLayout(self)
        self.body = QVBoxLayout()
        self.body.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(self.body)
        self.error = QLabel()
        self.error.setObjectName("errorLabel")
        self.error.setWordWrap(True)
        self.error.setAccessibleName(f"{accessible_name} error")
        self.error.hide()
        layout.addWidget(self.error)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        for b in buttons.buttons():  # Fusion's stock OK/Cancel icons look out of place
            b.setIcon(QIcon())
        self.buttons = buttons
        layout.addWidget(buttons)

    def problem(self) -> str | None:
        """Why the values cannot be taken, in words (None: they can)."""
        return None

    def show_error(self, text: str) -> None:
        self.error.setText(text)
        self.error.show()

    def accept(self) -> None:
        problem = self.problem()
        if problem:
            self.show_error(problem)
            return
        super().accept()
