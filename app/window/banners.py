"""The bars and readouts around the panes: the engine's loading/error banner, the compare bar
that sends one message to every open pane, the toolbar's model button and the status bar's
pool summary. Each shows the engine's state as the bridge reports it."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QToolButton,
    QWidget,
)

from app.bridges.engine_bridge import IDLE
from app.chat.input_box import InputBox
from app.core.model_names import model_id, weights
from app.ui import icons
from engine import EngineStatus


class LoadingIndicator(QWidget):
    """"Loading <model>…" with a busy bar, in the status bar: loading is no action for the
    user, and a banner above the panes that went away when it ended moved every pane up."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("loadingIndicator")
        self.setAccessibleName("Model loading")
        h = QHBoxLayout(self)
        h.setContentsMargins(0, 0, 0, 0)
        self.label = QLabel()
        self.label.setAccessibleName("Model loading status")
        h.addWidget(self.label)
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)  # busy indicator: loading reports no fraction
        self.progress.setFixedSize(90, 8)  # no taller than the status bar's text
        self.progress.setTextVisible(False)
        self.progress.setAccessibleName("Model loading progress")
        h.addWidget(self.progress)
        self.hide()

    def show_loading(self, model: str) -> None:
        self.label.setText(f"Loading {model}…")
        self.show()


class EngineBanner(QFrame):
    """A load error, above the panes, with Retry and Settings (loading itself shows in the
    status bar, `loading`, which the window places there)."""

    settingsRequested = Signal()
    retryRequested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("engineBanner")
        self.setAccessibleName("Engine status")
        h = QHBoxLayout(self)
        h.setContentsMargins(14, 8, 10, 8)
        self.label = QLabel()
        self.label.setAccessibleName("Engine status message")
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        h.addWidget(self.label, 1)
        self.retry = QPushButton("Retry")
        self.retry.setAccessibleName("Retry loading the model")
        self.retry.clicked.connect(self.retryRequested)
        h.addWidget(self.retry)
        self.settings = QPushButton("Settings…")
        self.settings.setAccessibleName("Open model settings")
        self.settings.clicked.connect(self.settingsRequested)
        h.addWidget(self.settings)
        self.loading = LoadingIndicator()

    def show_status(self, status: str, model: str, error: str | None) -> None:
        """Loading (also before the engine starts), hidden when ready, the error on failure."""
        if status in (EngineStatus.LOADING, IDLE):
            self.show_loading(model)
        elif status == EngineStatus.READY:
            self.hide()
            self.loading.hide()
        elif status == EngineStatus.ERROR:
            self.show_error(error or "unknown error")

    def show_loading(self, model: str) -> None:
        self.hide()
        self.loading.show_loading(model)

    def show_error(self, message: str) -> None:
        self.loading.hide()
        self.setProperty("kind", "error")
        self.label.setText(f"The model could not be loaded: {message}")
        self.retry.show()
        self.settings.show()
        self._repolish()
        self.show()

    def _repolish(self) -> None:
        self.style().unpolish(self)
        self.style().polish(self)


class SpeedBanner(QFrame):
    """Why prompts are slow, when MLX's CPU matmuls run on its bundled BLAS (Linux without
    OpenBLAS: about 20x slower prefill, app/core/openblas.py); dismissed for this run."""

    def __init__(self, problem: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("speedBanner")
        self.setAccessibleName("Speed warning")
        h = QHBoxLayout(self)
        h.setContentsMargins(14, 8, 10, 8)
        self.label = QLabel(problem)
        self.label.setAccessibleName("Why PagedChat is slow")
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        h.addWidget(self.label, 1)
        self.dismiss = QPushButton("Dismiss")
        self.dismiss.setAccessibleName("Dismiss the speed warning")
        self.dismiss.clicked.connect(self.hide)
        h.addWidget(self.dismiss)
        self.setVisible(bool(problem))


class CompareBar(QFrame):
    """One input that sends the same message to every open pane (compare mode)."""

    submitted = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("compareBar")
        self.setAccessibleName("Send to all panes")
        h = QHBoxLayout(self)
        h.setContentsMargins(14, 8, 14, 8)
        self.label = QLabel("All panes:")
        self.label.setObjectName("compareLabel")
        h.addWidget(self.label)
        frame = QFrame()
        frame.setObjectName("composer")
        f = QHBoxLayout(frame)
        f.setContentsMargins(10, 6, 6, 6)
        self.input = InputBox(frame)
        self.input.setAccessibleName("Message for all panes")
        self.input.setPlaceholderText("Message every open pane…")
        self.input.submitted.connect(self.submitted)
        f.addWidget(self.input, 1)
        self.button = QToolButton()
        self.button.setObjectName("sendButton")
        self.button.setAccessibleName("Send to all panes")
        self.button.setToolTip("Send to all panes (Enter)")
        self.button.setIcon(icons.icon("send-all", "#ffffff", 16))
        self.button.setFixedSize(30, 30)
        self.button.clicked.connect(lambda: self.submitted.emit(self.input.toPlainText()))
        f.addWidget(self.button, 0, Qt.AlignmentFlag.AlignBottom)
        h.addWidget(frame, 1)

    def set_pane_count(self, n: int) -> None:
        self.label.setText(f"All {n} panes:")


class ModelButton(QToolButton):
    """The model's name on the toolbar, with what the engine is doing with it."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("modelButton")
        self.setAccessibleName("Model")
        self.setToolTip("The model: click for its settings")  # richer once it is loaded
        self.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.refresh_icon()

    def refresh_icon(self) -> None:
        self.setIcon(icons.icon("chip"))

    def setText(self, text: str) -> None:  # noqa: N802 (Qt's name)
        """Never narrower than it has been: "… · loading…" turning into the shorter name moved
        every toolbar button after it to the left when loading ended."""
        super().setText(text)
        self.setMinimumWidth(max(self.minimumWidth(), self.sizeHint().width()))

    def show_status(self, status: str, name: str, info: Any) -> None:
        """`name` is the settings' label; once ready the engine's ModelInfo names the model."""
        if status in (EngineStatus.LOADING, IDLE):
            self.setText(f"{name} · loading…")
        elif status == EngineStatus.READY:
            full = getattr(info, "name", name) if info is not None else name
            label = model_id(full)  # the one name (app/core/model_names.py)
            self.setText(label)
            held = f"weights: {weights(full)} · " if weights(full) else ""
            if info is not None and not getattr(info, "paged", True):
                self.setToolTip(f"{label}\n{held}context {info.max_context:,} tokens · not "
                                "paged: runs on mlx-lm's own KV cache")
            elif info is not None:
                self.setToolTip(
                    f"{label}\n{held}context {info.max_context:,} tokens · "
                    f"{info.num_blocks:,} KV blocks of {info.block_size} tokens"
                    + (f" ({info.kv_dtype})" if getattr(info, "kv_dtype", "") else "")
                )
        elif status == EngineStatus.ERROR:
            self.setText(f"{name} · not loaded")
        else:
            self.setText(f"{name} · stopped")


class PoolLabel(QLabel):
    """The status bar's one-line pool summary, from each snapshot."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("poolLabel")
        self.setAccessibleName("KV pool usage")

    def show_snapshot(self, snap: Any) -> None:
        if snap is None:
            return
        if not getattr(snap, "paged", True):
            live = sum(1 for s in snap.sessions.values() if s.requests)
            text = f"Not paged (mlx-lm's KV cache) · {live} generating"
        else:
            text = (
                f"KV pool: {snap.used_blocks:,} / {snap.num_blocks:,} blocks in use"
                f" · {snap.shared_blocks} shared · {snap.cached_free_blocks} cached"
            )
        if text != self.text():
            self.setText(text)
