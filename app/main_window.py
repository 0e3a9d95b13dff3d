"""The main window: conversation sidebar | one to four chat panes | KV monitor dock.

It arranges panes (open, close, focus with Ctrl/⌘+1..4, send to all), shows the engine's
loading and error states, applies settings (restarting the engine when the model or pool
changes, open chats survive), and saves/restores its layout (geometry, splitters, dock, open
panes). Chat behaviour itself lives in ChatSession; this class only wires things together.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from typing import Any

from PySide6.QtCore import QByteArray, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QDialog,
    QDockWidget,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QToolBar,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app import icons
from app.chat.input_box import InputBox
from app.chat.pane import ChatPane
from app.chat.session import ChatSession, SessionManager
from app.core import secrets
from app.core.app_settings import AppSettings
from app.core.records import ChatSettings
from app.settings_dialog import SettingsDialog
from app.sidebar import Sidebar
from app.storage_banner import attach_storage_banner
from app.theme import theme_manager

MAX_PANES = 4
LAYOUT_KEY = "window_layout"
APP_NAME = "PagedChat"


def _b64(data: QByteArray) -> str:
    return bytes(data.toBase64().data()).decode("ascii")


def _from_b64(text: Any) -> QByteArray:
    if not isinstance(text, str):
        return QByteArray()
    return QByteArray.fromBase64(text.encode("ascii"))


class EngineBanner(QFrame):
    """Loading progress or a load error, above the panes."""

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
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)  # busy indicator: loading reports no fraction
        self.progress.setFixedWidth(140)
        self.progress.setTextVisible(False)
        self.progress.setAccessibleName("Model loading")
        h.addWidget(self.progress)
        self.retry = QPushButton("Retry")
        self.retry.setAccessibleName("Retry loading the model")
        self.retry.clicked.connect(self.retryRequested)
        h.addWidget(self.retry)
        self.settings = QPushButton("Settings…")
        self.settings.setAccessibleName("Open model settings")
        self.settings.clicked.connect(self.settingsRequested)
        h.addWidget(self.settings)

    def show_loading(self, model: str) -> None:
        self.setProperty("kind", "loading")
        self.label.setText(f"Loading {model}…")
        self.progress.show()
        self.retry.hide()
        self.settings.hide()
        self._repolish()
        self.show()

    def show_error(self, message: str) -> None:
        self.setProperty("kind", "error")
        self.label.setText(f"The model could not be loaded: {message}")
        self.progress.hide()
        self.retry.show()
        self.settings.show()
        self._repolish()
        self.show()

    def _repolish(self) -> None:
        self.style().unpolish(self)
        self.style().polish(self)


class CompareBar(QFrame):
    """One input that sends the same message to every open pane (compare mode)."""

    submitted = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("compareBar")
        self.setAccessibleName("Send to all panes")
        h = QHBoxLayout(self)
        h.setContentsMargins(14, 8, 14, 8)
        label = QLabel("All panes:")
        label.setObjectName("compareLabel")
        h.addWidget(label)
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


class MainWindow(QMainWindow):
    def __init__(
        self,
        store: Any,
        bridge: Any,
        settings: AppSettings | None = None,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setObjectName("mainWindow")
        self.setWindowTitle(APP_NAME)
        self.setAccessibleName(APP_NAME)
        self.store = store
        self.bridge = bridge
        self.settings = settings or AppSettings.load(store)
        self.manager = SessionManager(store, bridge, self)
        self._apply_default_chat_settings()
        self.panes: list[ChatPane] = []
        self.focused_pane: ChatPane | None = None
        self._quitting = False
        self._closed = False
        self.setUnifiedTitleAndToolBarOnMac(True)
        self._build()
        self.storage_banner = attach_storage_banner(self)  # save faults, recovered database
        self._build_actions()
        self._build_menus()
        self._build_toolbar()
        self._wire()
        self.restore_layout()
        self._on_status(bridge.status)

    # ---- construction --------------------------------------------------------------------

    def _build(self) -> None:
        self.sidebar = Sidebar(self.store, self)
        self.workspace = QWidget()
        self.workspace.setObjectName("workspace")
        w = QVBoxLayout(self.workspace)
        w.setContentsMargins(0, 0, 0, 0)
        w.setSpacing(0)
        self.banner = EngineBanner(self.workspace)
        self.banner.hide()
        w.addWidget(self.banner)
        self.pane_splitter = QSplitter(Qt.Orientation.Horizontal)
        self.pane_splitter.setObjectName("paneSplitter")
        self.pane_splitter.setChildrenCollapsible(False)
        self.pane_splitter.setHandleWidth(1)
        w.addWidget(self.pane_splitter, 1)
        self.compare_bar = CompareBar(self.workspace)
        self.compare_bar.hide()
        w.addWidget(self.compare_bar)

        self.main_splitter = QSplitter(Qt.Orientation.Horizontal)
        self.main_splitter.setObjectName("mainSplitter")
        self.main_splitter.setHandleWidth(1)
        self.main_splitter.addWidget(self.sidebar)
        self.main_splitter.addWidget(self.workspace)
        self.main_splitter.setStretchFactor(0, 0)
        self.main_splitter.setStretchFactor(1, 1)
        self.main_splitter.setSizes([240, 1000])
        self.setCentralWidget(self.main_splitter)

        self.monitor_dock = QDockWidget("KV Cache", self)
        self.monitor_dock.setObjectName("kvMonitorDock")
        self.monitor_dock.setAccessibleName("KV cache monitor")
        self.monitor_dock.setAllowedAreas(
            Qt.DockWidgetArea.RightDockWidgetArea | Qt.DockWidgetArea.BottomDockWidgetArea
        )
        self.monitor_dock.setWidget(self._make_monitor())
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.monitor_dock)

        self.pool_label = QLabel()
        self.pool_label.setObjectName("poolLabel")
        self.pool_label.setAccessibleName("KV pool usage")
        self.statusBar().addPermanentWidget(self.pool_label)
        self.statusBar().setSizeGripEnabled(False)
        self.resize(1380, 860)

    def _make_monitor(self) -> QWidget:
        """The monitor from app.monitor.create_monitor if that exists, else a placeholder."""
        try:
            module = importlib.import_module("app.monitor")
            factory = getattr(module, "create_monitor", None)
            if callable(factory):
                widget = factory(self.bridge, self.monitor_dock)
                if isinstance(widget, QWidget):
                    return widget
        except Exception as exc:  # a broken monitor must not keep the app from starting
            label = QLabel(f"The KV monitor failed to start: {exc}")
            label.setWordWrap(True)
            return label
        label = QLabel("KV cache monitor\n(not installed)")
        label.setObjectName("monitorPlaceholder")
        label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        label.setMinimumWidth(220)
        return label

    def _action(
        self,
        text: str,
        slot: Any,
        shortcut: QKeySequence | QKeySequence.StandardKey | str | None = None,
        icon_name: str | None = None,
        tip: str | None = None,
    ) -> QAction:
        a = QAction(text, self)
        if shortcut is not None:
            seq = QKeySequence(shortcut)
            a.setShortcut(seq)
        if icon_name:
            a.setIcon(icons.icon(icon_name))
            a.setProperty("icon_name", icon_name)
        a.setToolTip(tip or text.replace("&", "").rstrip("…"))
        a.triggered.connect(slot)
        self.addAction(a)  # shortcuts work even with the menu bar hidden
        return a

    def _build_actions(self) -> None:
        A = self._action
        self.act_new_chat = A(
            "&New Chat",
            lambda: self.new_chat(),
            QKeySequence.StandardKey.New,
            "new-chat",
            "New chat (in the focused pane)",
        )
        self.act_new_pane = A(
            "New &Pane",
            lambda: self.new_chat(new_pane=True),
            "Ctrl+Shift+N",
            "split",
            "Split: a new chat in a new pane",
        )
        self.act_close_pane = A(
            "&Close Pane", self.close_focused_pane, QKeySequence.StandardKey.Close
        )
        self.act_quit = A("&Quit PagedChat", self.quit, QKeySequence.StandardKey.Quit)
        self.act_quit.setMenuRole(QAction.MenuRole.QuitRole)
        prefs = QKeySequence(QKeySequence.StandardKey.Preferences)
        self.act_settings = A(
            "&Settings…", self.open_settings, prefs if not prefs.isEmpty() else "Ctrl+,", "settings"
        )
        self.act_settings.setMenuRole(QAction.MenuRole.PreferencesRole)
        self.act_find = A("&Find Chats", self.focus_search, QKeySequence.StandardKey.Find)
        self.act_rename = A("&Rename Chat…", self.rename_focused_chat, "F2")
        self.act_delete = A("&Delete Chat…", self.delete_focused_chat)
        self.act_send_all = A(
            "Send to &All Panes",
            self.toggle_compare,
            "Ctrl+Shift+Return",
            "send-all",
            "Send one message to every open pane",
        )
        self.act_send_all.setCheckable(True)
        self.act_stop = A("S&top", self.stop_focused, "Ctrl+.")
        self.act_stop_all = A("Stop &All", self.stop_all, "Ctrl+Shift+.")
        self.act_regen = A("&Regenerate", lambda: self._regen(1), "Ctrl+R")
        self.act_regen3 = A("Regenerate &3 Alternatives", lambda: self._regen(3), "Ctrl+Shift+R")
        self.act_chat_settings = A("Chat &Settings…", self.open_chat_settings, "Ctrl+Shift+,")
        self.act_branch = A("&Branch From Last Message", self.branch_focused, "Ctrl+Shift+B")
        self.act_focus = []
        for i in range(MAX_PANES):
            a = A(f"Focus Pane &{i + 1}", lambda _c=False, i=i: self.focus_pane(i), f"Ctrl+{i + 1}")
            self.act_focus.append(a)
        self.act_sidebar = A("Show &Sidebar", self.toggle_sidebar, "Ctrl+Shift+S")
        self.act_sidebar.setCheckable(True)
        self.act_sidebar.setChecked(True)
        self.act_monitor = self.monitor_dock.toggleViewAction()
        self.act_monitor.setText("Show &KV Monitor")
        self.act_monitor.setShortcut(QKeySequence("Ctrl+Shift+M"))
        self.act_monitor.setIcon(icons.icon("monitor"))
        self.act_monitor.setProperty("icon_name", "monitor")
        self.act_about = A("&About PagedChat", self.about)
        self.act_about.setMenuRole(QAction.MenuRole.AboutRole)
        self.theme_group = QActionGroup(self)
        self.theme_actions: dict[str, QAction] = {}
        for value, label in (("system", "&System"), ("light", "&Light"), ("dark", "&Dark")):
            a = QAction(label, self, checkable=True)
            a.triggered.connect(lambda _c=False, v=value: self.set_theme(v))
            self.theme_group.addAction(a)
            self.theme_actions[value] = a
        self.theme_actions.get(self.settings.theme, self.theme_actions["system"]).setChecked(True)

    def _build_menus(self) -> None:
        mb = self.menuBar()
        m = mb.addMenu("&File")
        m.addActions([self.act_new_chat, self.act_new_pane])
        m.addSeparator()
        m.addAction(self.act_close_pane)
        m.addSeparator()
        m.addAction(self.act_quit)
        m = mb.addMenu("&Edit")
        m.addActions([self.act_find, self.act_rename, self.act_delete])
        m.addSeparator()
        m.addAction(self.act_settings)
        m = mb.addMenu("&Chat")
        m.addActions([self.act_send_all, self.act_stop, self.act_stop_all])
        m.addSeparator()
        m.addActions([self.act_regen, self.act_regen3, self.act_branch])
        m.addSeparator()
        m.addAction(self.act_chat_settings)
        m = mb.addMenu("&View")
        m.addActions(self.act_focus)
        m.addSeparator()
        m.addActions([self.act_sidebar, self.act_monitor])
        t = m.addMenu("&Theme")
        t.addActions(list(self.theme_actions.values()))
        m = mb.addMenu("&Help")
        m.addAction(self.act_about)

    def _build_toolbar(self) -> None:
        tb = QToolBar("Toolbar", self)
        tb.setObjectName("mainToolbar")
        tb.setAccessibleName("Toolbar")
        tb.setMovable(False)
        tb.setIconSize(icons.icon_size(18))
        tb.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.model_button = QToolButton()
        self.model_button.setObjectName("modelButton")
        self.model_button.setAccessibleName("Model")
        self.model_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.model_button.setIcon(icons.icon("chip"))
        self.model_button.clicked.connect(self.open_settings)
        tb.addWidget(self.model_button)
        tb.addSeparator()
        tb.addAction(self.act_new_chat)
        tb.addAction(self.act_new_pane)
        tb.addAction(self.act_send_all)
        spacer = QWidget()
        spacer.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        tb.addWidget(spacer)
        tb.addAction(self.act_monitor)
        tb.addAction(self.act_settings)
        for a, text in (
            (self.act_new_chat, "New Chat"),
            (self.act_new_pane, "Split"),
            (self.act_send_all, "Send to All"),
            (self.act_monitor, "Monitor"),
            (self.act_settings, "Settings"),
        ):
            a.setIconText(text)
            w = tb.widgetForAction(a)
            if w is not None:
                w.setAccessibleName(text)
        self.addToolBar(Qt.ToolBarArea.TopToolBarArea, tb)
        self.toolbar = tb

    def _wire(self) -> None:
        self.sidebar.newChatRequested.connect(lambda: self.new_chat())
        self.sidebar.view.openRequested.connect(self.open_chat)
        self.sidebar.view.deleteRequested.connect(lambda cid: self.delete_chat(cid))
        self.sidebar.model.renameRequested.connect(self.manager.rename)
        self.manager.conversationsChanged.connect(self._conversations_changed)
        self.manager.busyChanged.connect(self.sidebar.model.set_busy)
        self.bridge.statusChanged.connect(self._on_status)
        self.bridge.snapshotUpdated.connect(self._on_snapshot)
        self.banner.settingsRequested.connect(self.open_settings)
        self.banner.retryRequested.connect(self.restart_engine)
        self.compare_bar.submitted.connect(self._compare_submit)
        theme_manager().changed.connect(self._theme_changed)
        self.pane_splitter.splitterMoved.connect(lambda *_: self._save_soon())

    # ---- panes ---------------------------------------------------------------------------

    def _add_pane(self, session: ChatSession) -> ChatPane:
        pane = ChatPane(session, self.bridge, self.pane_splitter)
        pane.focusedIn.connect(self._pane_focused)
        pane.closeRequested.connect(self.close_pane)
        pane.branchRequested.connect(self.branch)
        self.pane_splitter.addWidget(pane)
        self.panes.append(pane)
        self._renumber()
        sizes = [1] * len(self.panes)
        self.pane_splitter.setSizes([10_000 * s for s in sizes])
        return pane

    def _renumber(self) -> None:
        for i, p in enumerate(self.panes):
            p.set_number(i + 1)
            p.close_button.setEnabled(len(self.panes) > 1)
        for i, a in enumerate(self.act_focus):
            a.setEnabled(i < len(self.panes))
        self.act_new_pane.setEnabled(len(self.panes) < MAX_PANES)
        self.act_close_pane.setEnabled(len(self.panes) > 1)
        self.compare_bar.findChild(QLabel).setText(f"All {len(self.panes)} panes:")

    def pane_for(self, conversation_id: str) -> ChatPane | None:
        for p in self.panes:
            if p.session is not None and p.session.id == conversation_id:
                return p
        return None

    def open_chat(self, conversation_id: str, new_pane: bool = False) -> ChatPane | None:
        """Show a chat: focus its pane if open, else in a new pane or the focused one."""
        existing = self.pane_for(conversation_id)
        if existing is not None:
            self._pane_focused(existing)
            existing.focus_input()
            return existing
        session = self.manager.get(conversation_id)
        if session is None:
            self.statusBar().showMessage("That chat no longer exists.", 5000)
            return None
        if not self.panes or (new_pane and len(self.panes) < MAX_PANES):
            pane = self._add_pane(session)
        else:
            if new_pane:
                self.statusBar().showMessage(
                    f"At most {MAX_PANES} panes: opened in the focused pane instead.", 5000
                )
            pane = self.focused_pane or self.panes[-1]
            previous = pane.session
            pane.set_session(session)
            self._drop_if_unused(previous)
        self._pane_focused(pane)
        pane.focus_input()
        self._save_soon()
        return pane

    def _drop_if_unused(self, session: ChatSession | None) -> None:
        """A "New Chat" that was never written in disappears when its pane moves on."""
        if (
            session is not None
            and not session.tree.by_id
            and not session.busy
            and self.pane_for(session.id) is None
        ):
            self.manager.delete(session.id)

    def new_chat(self, new_pane: bool = False) -> ChatPane | None:
        if new_pane and len(self.panes) >= MAX_PANES:
            self.statusBar().showMessage(f"At most {MAX_PANES} panes side by side.", 5000)
            return None
        session = self.manager.create()
        return self.open_chat(session.id, new_pane=new_pane)

    def close_pane(self, pane: ChatPane) -> None:
        if pane not in self.panes or len(self.panes) <= 1:
            return
        i = self.panes.index(pane)
        self.panes.remove(pane)
        pane.detach()
        pane.hide()
        pane.setParent(None)
        pane.deleteLater()
        self._renumber()
        self._pane_focused(self.panes[min(i, len(self.panes) - 1)])
        if self.focused_pane is not None:
            self.focused_pane.focus_input()
        self._save_soon()

    def close_focused_pane(self) -> None:
        if self.focused_pane is not None:
            self.close_pane(self.focused_pane)

    def focus_pane(self, i: int) -> None:
        if 0 <= i < len(self.panes):
            self._pane_focused(self.panes[i])
            self.panes[i].focus_input()

    def _pane_focused(self, pane: ChatPane) -> None:
        if pane is self.focused_pane:
            return
        self.focused_pane = pane
        for p in self.panes:
            p.set_focused(p is pane)
        if pane.session is not None:
            self.sidebar.select(pane.session.id)
            self.setWindowTitle(f"{pane.session.title} — {APP_NAME}")

    # ---- chat commands -------------------------------------------------------------------

    def send_to_all(self, text: str) -> int:
        """Send `text` to every open pane (compare mode); returns how many accepted it."""
        if not text.strip():
            self.statusBar().showMessage("Type a message first.", 4000)
            return 0
        sent = 0
        for p in self.panes:
            if p.session is not None and p.session.busy:
                p.show_notice("Still answering: this pane did not get the message.")
                continue
            if p.session is not None and p.session.send(text):
                sent += 1
        return sent

    def _compare_submit(self, text: str) -> None:
        if self.send_to_all(text):
            self.compare_bar.input.clear()

    def toggle_compare(self, checked: bool | None = None) -> None:
        on = self.act_send_all.isChecked() if checked is None else bool(checked)
        self.act_send_all.setChecked(on)
        self.compare_bar.setVisible(on)
        if on:
            self.compare_bar.input.setFocus()

    def stop_focused(self) -> None:
        if self.focused_pane is not None:
            self.focused_pane.stop()

    def stop_all(self) -> None:
        for s in list(self.manager.sessions.values()):
            s.stop()

    def _regen(self, n: int) -> None:
        if self.focused_pane is not None:
            self.focused_pane.regenerate(None, n)

    def open_chat_settings(self) -> None:
        if self.focused_pane is not None:
            self.focused_pane.open_settings()

    def branch_focused(self) -> None:
        pane = self.focused_pane
        if pane is None or pane.session is None:
            return
        path = pane.session.active_path()
        if path:
            self.branch(pane.session, path[-1].id)

    def branch(self, session: ChatSession, message_id: str) -> ChatPane | None:
        """A new chat from the path up to `message_id`, opened beside the current one."""
        new = self.manager.branch(session, message_id)
        return self.open_chat(new.id, new_pane=len(self.panes) < MAX_PANES)

    def focus_search(self) -> None:
        if not self.sidebar.isVisible():
            self.toggle_sidebar(True)
        self.sidebar.search.setFocus()
        self.sidebar.search.selectAll()

    def rename_focused_chat(self) -> None:
        pane = self.focused_pane
        if pane is None or pane.session is None:
            return
        self.sidebar.select(pane.session.id)
        self.sidebar.view.edit(self.sidebar.view.currentIndex())

    def delete_focused_chat(self) -> None:
        if self.focused_pane is not None and self.focused_pane.session is not None:
            self.delete_chat(self.focused_pane.session.id)

    def delete_chat(self, conversation_id: str, confirm: bool = True) -> bool:
        conv = self.store.get_conversation(conversation_id)
        if conv is None:
            return False
        if confirm:
            answer = QMessageBox.question(
                self,
                "Delete Chat",
                f"Delete “{conv.title}” and all its messages? This cannot be undone.",
                QMessageBox.StandardButton.Delete | QMessageBox.StandardButton.Cancel,
                QMessageBox.StandardButton.Cancel,
            )
            if answer != QMessageBox.StandardButton.Delete:
                return False
        pane = self.pane_for(conversation_id)
        self.manager.delete(conversation_id)
        if pane is not None:
            if len(self.panes) > 1:
                self.close_pane(pane)
            else:
                others = self.store.list_conversations()
                session = self.manager.get(others[0].id) if others else self.manager.create()
                pane.set_session(session)
                self.focused_pane = None
                self._pane_focused(pane)
        self._save_soon()
        return True

    def toggle_sidebar(self, checked: bool | None = None) -> None:
        on = self.act_sidebar.isChecked() if checked is None else bool(checked)
        self.act_sidebar.setChecked(on)
        self.sidebar.setVisible(on)

    def about(self) -> None:
        QMessageBox.about(
            self,
            "About PagedChat",
            "<b>PagedChat</b><br/>Several local-LLM chats side by side, streaming at once "
            "from one engine whose KV caches share a paged block pool.",
        )

    # ---- engine status and settings ------------------------------------------------------

    def _on_status(self, status: str) -> None:
        name = self.settings.model_label()
        info = self.bridge.model_info
        if status == "loading" or status == "idle":
            self.banner.show_loading(name)
            self.model_button.setText(f"{name} · loading…")
        elif status == "ready":
            self.banner.hide()
            label = getattr(info, "name", name) if info is not None else name
            self.model_button.setText(label)
            if info is not None:
                self.model_button.setToolTip(
                    f"{label}\ncontext {info.max_context:,} tokens · {info.num_blocks:,} KV blocks "
                    f"of {info.block_size} tokens"
                )
        elif status == "error":
            self.banner.show_error(self.bridge.load_error or "unknown error")
            self.model_button.setText(f"{name} · not loaded")
        else:
            self.model_button.setText(f"{name} · stopped")

    def _on_snapshot(self, snap: Any) -> None:
        if snap is None:
            return
        used = snap.used_blocks
        text = (
            f"KV pool: {used:,} / {snap.num_blocks:,} blocks in use · {snap.shared_blocks} shared"
            f" · {snap.cached_free_blocks} cached"
        )
        if text != self.pool_label.text():
            self.pool_label.setText(text)

    def open_settings(self) -> None:
        dialog = SettingsDialog(self.settings, self)
        if dialog.exec() == QDialog.DialogCode.Accepted:
            self.apply_settings(dialog.value(), token_changed=dialog.token_changed)

    def apply_settings(self, new: AppSettings, token_changed: bool = False) -> bool:
        """Save settings; restart the engine if the model or pool changed. False if invalid."""
        problem = new.validate()
        if problem:
            QMessageBox.warning(self, "Settings", problem)
            return False
        old_key = self.settings.engine_key()
        self.settings = new
        new.save(self.store)
        self._apply_default_chat_settings()
        theme_manager().apply(new.theme)
        self.theme_actions[new.theme].setChecked(True)
        if new.engine_key() != old_key or (token_changed and new.model_kind == "hf"):
            self.restart_engine()
        return True

    def _apply_default_chat_settings(self) -> None:
        self.manager.default_settings = ChatSettings(
            system_prompt=self.settings.default_system_prompt,
            sampling=self.settings.default_sampling,
        )

    def set_theme(self, theme: str) -> None:
        self.settings.theme = theme
        saved = AppSettings.load(self.store)  # not this run's --model/--kv overrides
        saved.theme = theme
        saved.save(self.store)
        theme_manager().apply(theme)
        self.theme_actions[theme].setChecked(True)

    def restart_engine(self) -> None:
        """Stop the engine and start one for the current settings; chats stay open."""
        self.manager.interrupt_all()
        secrets.export_hf_token()
        try:
            config = self.settings.engine_config()
        except ValueError as exc:
            self.banner.show_error(str(exc))
            return
        self.banner.show_loading(self.settings.model_label())
        asyncio.ensure_future(self.bridge.restart(config))

    def _theme_changed(self, _dark: bool) -> None:
        for a in self.findChildren(QAction):
            name = a.property("icon_name")
            if name:
                a.setIcon(icons.icon(name))
        self.model_button.setIcon(icons.icon("chip"))
        self.sidebar.refresh_icons()
        for p in self.panes:
            p.refresh_icons()

    def _conversations_changed(self) -> None:
        self.sidebar.reload()
        if self.focused_pane is not None and self.focused_pane.session is not None:
            self.setWindowTitle(f"{self.focused_pane.session.title} — {APP_NAME}")

    # ---- layout persistence --------------------------------------------------------------

    def _save_soon(self) -> None:
        QTimer.singleShot(0, self.save_layout)

    def save_layout(self) -> None:
        if self._closed:
            return
        self.store.set_value(
            LAYOUT_KEY,
            {
                "geometry": _b64(self.saveGeometry()),
                "state": _b64(self.saveState()),
                "main_splitter": _b64(self.main_splitter.saveState()),
                "pane_splitter": _b64(self.pane_splitter.saveState()),
                "panes": [p.session.id for p in self.panes if p.session is not None],
                "focused": self.panes.index(self.focused_pane)
                if self.focused_pane in self.panes
                else 0,
                "sidebar": self.sidebar.isVisibleTo(self) if self.isVisible() else True,
                "compare": self.act_send_all.isChecked(),
            },
        )

    def restore_layout(self) -> None:
        layout = self.store.get_value(LAYOUT_KEY, {}) or {}
        if not isinstance(layout, dict):
            layout = {}
        self.restoreGeometry(_from_b64(layout.get("geometry")))
        self.restoreState(_from_b64(layout.get("state")))
        self.main_splitter.restoreState(_from_b64(layout.get("main_splitter")))
        ids = [i for i in layout.get("panes", []) if isinstance(i, str)][:MAX_PANES]
        self._prune_empty_chats(keep=set(ids))
        for cid in ids:
            session = self.manager.get(cid)
            if session is not None and self.pane_for(cid) is None:
                self._add_pane(session)
        if not self.panes:
            convs = self.store.list_conversations()
            session = self.manager.get(convs[0].id) if convs else self.manager.create()
            if session is not None:
                self._add_pane(session)
        if len(self.panes) == len(ids):
            self.pane_splitter.restoreState(_from_b64(layout.get("pane_splitter")))
        focused = layout.get("focused", 0)
        self._pane_focused(
            self.panes[
                focused if isinstance(focused, int) and 0 <= focused < len(self.panes) else 0
            ]
        )
        if layout.get("sidebar") is False:
            self.toggle_sidebar(False)
        if layout.get("compare"):
            self.toggle_compare(True)
        self.sidebar.reload()

    def _prune_empty_chats(self, keep: set[str]) -> None:
        """Drop untouched "New Chat"s left over from earlier runs (not shown in a pane)."""
        for conv in self.store.list_conversations():
            if conv.id not in keep and not self.store.load_messages(conv.id):
                self.store.delete_conversation(conv.id)

    # ---- quitting ------------------------------------------------------------------------

    def quit(self) -> None:
        self._quitting = True
        self.close()
        from PySide6.QtWidgets import QApplication

        QApplication.quit()

    def shutdown_chats(self) -> None:
        """Cancel every reply, keeping partial text marked interrupted; save the layout."""
        self.save_layout()
        self.manager.interrupt_all()
        self._closed = True

    def closeEvent(self, event: QCloseEvent) -> None:
        if sys.platform == "darwin" and not self._quitting:
            # Mac convention: closing the window keeps the app (and its chats) running.
            self.save_layout()
            self.hide()
            event.ignore()
            return
        if not self._closed:
            self.shutdown_chats()
        event.accept()

    def all_sessions(self) -> dict[str, ChatSession]:
        return dict(self.manager.sessions)
