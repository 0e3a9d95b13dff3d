"""The desktop app's API server: a Server menu (a toggle and its settings) and a status-bar
widget showing the URL with a button that copies the key.

The server runs in this process on the app's own Engine (whichever the bridge holds now,
so a model change needs no restart): uvicorn in a thread of its own with its own asyncio
loop, talking to the engine only through its thread-safe handle API. Starting and stopping
happen in a worker thread (stopping waits for open streams to end), never on the GUI thread.
Its settings live in the app database under their own key; the bearer key lives only in the
OS keychain (or PAGEDCHAT_API_KEY), never in the database.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QMenu,
    QPushButton,
    QSpinBox,
    QWidget,
)

from app.server import ServerOptions, ServerThread, create_app
from app.server.keys import KeyUnavailable, resolve_key

SETTINGS_KEY = "api_server"
DEFAULT_PORT = 8080
FILES_FOLDER = "api-files"  # /v1/files and /v1/batches, in the data folder


@dataclass
class ServerSettings:
    """port 0 picks a free port (tests); the dialog offers 1024-65535."""

    port: int = DEFAULT_PORT
    start_at_launch: bool = False

    @classmethod
    def load(cls, store: Any) -> ServerSettings:
        data = store.get_value(SETTINGS_KEY) or {}
        try:
            port = int(data.get("port", DEFAULT_PORT))
        except (TypeError, ValueError):
            port = DEFAULT_PORT
        port = port if 0 <= port <= 65535 else DEFAULT_PORT
        return cls(port=port, start_at_launch=bool(data.get("start_at_launch", False)))

    def save(self, store: Any) -> None:
        store.set_value(SETTINGS_KEY, {"port": self.port, "start_at_launch": self.start_at_launch})


class ServerSettingsDialog(QDialog):
    def __init__(self, settings: ServerSettings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("API Server Settings")
        self.setAccessibleName("API server settings")
        form = QFormLayout(self)
        self.port = QSpinBox()
        self.port.setRange(1024, 65535)
        self.port.setValue(settings.port if settings.port >= 1024 else DEFAULT_PORT)
        self.port.setAccessibleName("API server port")
        form.addRow("&Port (127.0.0.1 only):", self.port)
        self.at_launch = QCheckBox("Start the server when PagedChat starts")
        self.at_launch.setChecked(settings.start_at_launch)
        self.at_launch.setAccessibleName("Start the API server at launch")
        form.addRow(self.at_launch)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def value(self) -> ServerSettings:
        return ServerSettings(port=self.port.value(), start_at_launch=self.at_launch.isChecked())


class ServerStatus(QWidget):
    """Status-bar widget: the URL while the server runs, and a Copy Key button."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        h = QHBoxLayout(self)
        h.setContentsMargins(0, 0, 0, 0)
        self.label = QLabel()
        self.label.setObjectName("apiServerLabel")
        self.label.setAccessibleName("API server address")
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.copy_key = QPushButton("Copy Key")
        self.copy_key.setAccessibleName("Copy the API server key")
        self.copy_key.setToolTip("Copy the bearer key that API clients must send")
        h.addWidget(self.label)
        h.addWidget(self.copy_key)
        self.hide()


class ServerPanel(QObject):
    """Owns the in-app server. ``install()`` adds its menu and status widget to a window."""

    stateChanged = Signal(bool, str)  # running, the URL (running) or an error ("" if none)

    def __init__(self, window: Any, store: Any, bridge: Any) -> None:
        super().__init__(window)
        self.window = window
        self.store = store
        self.bridge = bridge
        self.settings = ServerSettings.load(store)
        self.server: ServerThread | None = None
        self.url = ""
        self.error = ""
        self._key: str | None = None
        self._busy = False
        self._stopping: ServerThread | None = None

        self.toggle = QAction("Run &API Server", window, checkable=True)
        self.toggle.setToolTip("Serve the OpenAI API on 127.0.0.1 from this app's engine")
        self.toggle.toggled.connect(self._toggled)
        self.settings_action = QAction("API Server &Settings…", window)
        self.settings_action.triggered.connect(self.open_settings)
        self.copy_url_action = QAction("Copy API &URL", window)
        self.copy_url_action.triggered.connect(self.copy_url)
        self.menu = QMenu("&Server", window)
        self.menu.addActions([self.toggle, self.copy_url_action, self.settings_action])
        self.status = ServerStatus()
        self.status.copy_key.clicked.connect(self.copy_key)
        self.stateChanged.connect(self._show_state)
        self._show_state(False, "")

    # ---- wiring ---------------------------------------------------------------------------

    def install(self) -> None:
        """Add the Server menu and the status widget; start now if set to start at launch."""
        bar = self.window.menuBar()
        help_menu = next((a for a in bar.actions() if a.text().replace("&", "") == "Help"), None)
        if help_menu is not None:
            bar.insertMenu(help_menu, self.menu)
        else:
            bar.addMenu(self.menu)
        status_bar = self.window.statusBar()
        status_bar.addPermanentWidget(self.status)
        # the bar is as tall from launch as with the Copy Key button in it: it grew 8 px when
        # the server started, and the whole window above it moved
        shown = [w for w in status_bar.findChildren(
            QWidget, options=Qt.FindChildOption.FindDirectChildrenOnly) if not w.isHidden()]
        tallest = max((w.sizeHint().height() for w in shown), default=0)
        margins = status_bar.sizeHint().height() - tallest
        button = self.status.copy_key.sizeHint().height()
        status_bar.setMinimumHeight(margins + max(button, self.status.sizeHint().height()))
        if self.settings.start_at_launch:
            self.toggle.setChecked(True)

    @property
    def running(self) -> bool:
        """Whether a server thread still runs (also while one is stopping)."""
        return any(s is not None and s.running for s in (self.server, self._stopping))

    # ---- start / stop (in a worker thread) ------------------------------------------------

    def _toggled(self, on: bool) -> None:
        if on and not self.running:
            self.start()
        elif not on and self.server is not None:
            self.stop()

    def start(self, previous: ServerThread | None = None) -> None:
        """Start in a worker thread (after stopping ``previous``, for a port change)."""
        if self._busy or (self.server is not None and self.server.running):
            return
        try:
            self._key, _ = resolve_key()
        except KeyUnavailable as exc:
            self._fail(str(exc))
            return
        self._busy = True
        data_dir = getattr(self.store, "data_dir", None)
        options = ServerOptions(api_key=self._key, files_dir=(
            None if data_dir is None else data_dir / FILES_FOLDER))
        port = self.settings.port

        def run() -> None:  # creating the app reads the batches folder: not on the GUI thread
            if previous is not None:
                previous.stop()
            try:
                server = ServerThread(create_app(lambda: self.bridge.engine, options),
                                      port=port)
                url = server.start()
            except Exception as exc:  # a busy port: shown to the user, the app goes on
                self._busy = False
                self.stateChanged.emit(False, str(exc))
                return
            self.server = server
            self._busy = False
            self.stateChanged.emit(True, url)

        threading.Thread(target=run, name="pagedchat-api-start", daemon=True).start()

    def stop(self) -> None:
        """Stop in a worker thread: open streams end with a final chunk first."""
        server, self.server = self.server, None
        if server is None:
            return
        self._stopping = server

        def run() -> None:
            server.stop()
            self._stopping = None
            self.stateChanged.emit(False, "")

        threading.Thread(target=run, name="pagedchat-api-stop", daemon=True).start()

    def shutdown(self) -> None:
        """On quit: end every API stream with a final chunk, then stop the server."""
        if self.server is not None:
            server, self.server = self.server, None
            server.stop()

    def _fail(self, message: str) -> None:
        self.stateChanged.emit(False, message)

    # ---- the UI ---------------------------------------------------------------------------

    def _show_state(self, running: bool, text: str) -> None:
        self.url = text if running else ""
        self.error = "" if running else text
        self.toggle.blockSignals(True)
        self.toggle.setChecked(running)
        self.toggle.blockSignals(False)
        self.copy_url_action.setEnabled(running)
        self.status.setVisible(running or bool(self.error))
        self.status.copy_key.setVisible(running)
        if running:
            self.status.label.setText(f"API: {text}")
            self.status.label.setToolTip("OpenAI-compatible server on this app's engine")
        elif self.error:
            self.status.label.setText("API server: not running")
            self.status.label.setToolTip(self.error)
            if hasattr(self.window, "statusBar"):
                self.window.statusBar().showMessage(f"API server: {self.error}", 10000)

    def copy_key(self) -> None:
        if self._key:
            QGuiApplication.clipboard().setText(self._key)
            self.window.statusBar().showMessage("API key copied to the clipboard.", 4000)

    def copy_url(self) -> None:
        if self.url:
            QGuiApplication.clipboard().setText(self.url)

    def open_settings(self) -> None:
        dialog = ServerSettingsDialog(self.settings, self.window)
        if dialog.exec() != QDialog.DialogCode.Accepted:
            return
        new = dialog.value()
        port_changed = new.port != self.settings.port
        self.settings = new
        new.save(self.store)
        if port_changed and self.running:
            previous, self.server = self.server, None
            self.start(previous)
