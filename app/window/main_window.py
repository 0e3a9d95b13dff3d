"""The main window: conversation sidebar | one to four chat panes | KV monitor dock.

It opens chats in panes (the pane deck, app/window/pane_deck.py), runs the commands of its
action table (app/window/actions.py), shows the engine's loading and error states
(app/window/banners.py), hands settings to their flow (app/settings/flow.py: saved,
applied, the engine restarted), and saves/restores its layout. Chat behaviour itself lives
in ChatSession; this class wires. It is also the monitor's view of the chats
(app/monitor/chats.py's Chats protocol).
"""

from __future__ import annotations

import sys
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QColor
from PySide6.QtWidgets import (
    QAbstractButton,
    QApplication,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.bridges.remote_bridge import RemoteBridge
from app.chat.pane import ChatPane
from app.chat.session import ChatSession, SessionManager
from app.chat.titler import ChatTitler
from app.core import openblas
from app.core.app_settings import AppSettings
from app.core.mcp import McpHub
from app.core.providers import ProviderRegistry
from app.library.flow import LibraryFlow
from app.library.folder_bar import ALL as ALL_FOLDERS
from app.library.sidebar import Sidebar
from app.monitor import create_monitor_dock
from app.settings.flow import SettingsFlow
from app.ui import colors
from app.ui.confirm import confirm_destructive
from app.ui.qt_util import from_b64, to_b64
from app.ui.theme import theme_manager
from app.window.actions import THEMES, build_actions, build_toolbar, refresh_icons, shortcut_rows
from app.window.banners import CompareBar, EngineBanner, ModelButton, PoolLabel, SpeedBanner
from app.window.batch_panel import BatchPanel
from app.window.context_watch import ContextWatch
from app.window.dock_fit import DockFitter
from app.window.pane_deck import MAX_PANES, PaneDeck
from app.window.server_panel import ServerPanel
from app.window.shortcuts_dialog import ShortcutsDialog
from app.window.storage_banner import attach_storage_banner

LAYOUT_KEY = "window_layout"
APP_NAME = "PagedChat"


class MainWindow(QMainWindow):
    chatHovered = Signal(object)  # the monitor's hover: session id of a pane, or None

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
        self.registry = ProviderRegistry(store)
        self.models_window: Any = None  # the Models window, made on first use (settings_flow)
        self.remote = RemoteBridge(self.registry, self)
        self.manager = SessionManager(store, bridge, self, remote=self.remote)
        self.tools = McpHub(store)  # MCP servers and their tools, for chats with tools on
        self.manager.tools = self.tools
        self.titler = ChatTitler(self.manager, bridge, self)  # titles by the model
        self.settings_flow = SettingsFlow(self)
        self.library_flow = LibraryFlow(self)
        self.settings_flow.apply_default_chat_settings()
        self._quitting = False
        self._closed = False
        self.setUnifiedTitleAndToolBarOnMac(True)
        self._build()
        self.storage_banner = attach_storage_banner(self)  # save faults, recovered database
        self.actions_by_key = build_actions(self)
        self.theme_actions = {v: self.actions_by_key[f"theme_{v}"] for v, _ in THEMES}
        self.theme_actions.get(self.settings.theme, self.theme_actions["system"]).setChecked(True)
        self.model_button = ModelButton()
        self.model_button.clicked.connect(lambda: self.settings_flow.open())
        self.toolbar = build_toolbar(self, self.actions_by_key, self.model_button)
        self._wire()
        self.server_panel = ServerPanel(self, store, bridge)
        self.server_panel.install()
        self.batch_panel = BatchPanel(self, store, bridge)  # File > Run Batch…
        self.batch_panel.install()
        self.restore_layout()
        self.dock_fitter = DockFitter(self, self.monitor_dock, self.sidebar)
        self.deck.countChanged.connect(lambda _n: QTimer.singleShot(0, self.dock_fitter.fit))
        self.settings_flow.show_status(bridge.status)

    # ---- construction --------------------------------------------------------------------

    def _build(self) -> None:
        self.sidebar = Sidebar(self.store, self)
        self.sidebar.model.model_label = self.registry.label
        self.registry.add_listener(self.sidebar.reload)
        self.workspace = QWidget()
        self.workspace.setObjectName("workspace")
        w = QVBoxLayout(self.workspace)
        w.setContentsMargins(0, 0, 0, 0)
        w.setSpacing(0)
        self.banner = EngineBanner(self.workspace)
        self.banner.hide()
        w.addWidget(self.banner)
        self.speed_banner = SpeedBanner(openblas.state().problem, self.workspace)
        w.addWidget(self.speed_banner)
        self.deck = PaneDeck(self.bridge, self.workspace)
        self.pane_splitter = self.deck.splitter
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

        self.monitor_dock = create_monitor_dock(self.bridge, self, self)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.monitor_dock)
        for button, tip in (("qt_dockwidget_floatbutton", "Float the KV monitor in a window"),
                            ("qt_dockwidget_closebutton", "Hide the KV monitor (Ctrl+Shift+M)")):
            b = self.monitor_dock.findChild(QAbstractButton, button)
            if b is not None:  # Qt's own title-bar buttons: a name but no tooltip
                b.setToolTip(tip)

        self.pool_label = PoolLabel()
        self.statusBar().addPermanentWidget(self.banner.loading)
        self.statusBar().addPermanentWidget(self.pool_label)
        self.statusBar().setSizeGripEnabled(False)
        self.resize(1380, 860)

    def _wire(self) -> None:
        self.sidebar.newChatRequested.connect(lambda: self.new_chat())
        self.sidebar.view.openRequested.connect(self.open_chat)
        self.sidebar.view.deleteRequested.connect(lambda cid: self.delete_chat(cid))
        self.sidebar.results.hitActivated.connect(self.show_hit)
        folders = self.sidebar.folders.view
        folders.newChatRequested.connect(lambda fid: self.new_chat(folder_id=fid))
        folders.deleteRequested.connect(lambda fid: self.library_flow.delete_folder(fid))
        folders.settingsRequested.connect(self.library_flow.edit_folder_settings)
        self.sidebar.model.renameRequested.connect(self.manager.rename)
        self.manager.conversationsChanged.connect(self._conversations_changed)
        self.manager.busyChanged.connect(self.sidebar.model.set_busy)
        self.context_watch = ContextWatch(self)  # the sidebar's "in memory / asleep on disk"
        self.sidebar.view.sleepRequested.connect(self.context_watch.sleep)
        self.sidebar.view.keepWarmRequested.connect(self.context_watch.keep_warm)
        self.bridge.statusChanged.connect(self.settings_flow.show_status)
        self.bridge.snapshotUpdated.connect(self.pool_label.show_snapshot)
        self.bridge.modelReady.connect(self.settings_flow.apply_default_chat_settings)
        self.banner.settingsRequested.connect(self.settings_flow.open)
        self.banner.retryRequested.connect(self.settings_flow.restart_engine)
        self.compare_bar.submitted.connect(self._compare_submit)
        self.compare_bar.input.cancelled.connect(lambda: self.toggle_compare(False))
        theme_manager().changed.connect(self._theme_changed)
        self.deck.focusChanged.connect(self._pane_focused)
        self.deck.countChanged.connect(self._pane_count_changed)
        self.deck.layoutChanged.connect(self._save_soon)
        self.deck.branchRequested.connect(self.branch)
        self.deck.chatHovered.connect(self.chatHovered)
        self.deck.notice.connect(lambda text: self.statusBar().showMessage(text, 5000))
        self.deck.countChanged.connect(lambda _n: self._name_grips())
        self._name_grips()

    def _name_grips(self) -> None:
        """Splitter handles are dragged, so screen readers list them: say what they resize."""
        for splitter, name in ((self.main_splitter, "Resize the sidebar"),
                               (self.pane_splitter, "Resize the panes")):
            for i in range(1, splitter.count()):
                splitter.handle(i).setAccessibleName(name)

    # ---- the chats, as the monitor sees them ----------------------------------------------

    def chat_title(self, session_id: str) -> str | None:
        batch = self.batch_panel.title_for(session_id)
        if batch is not None:  # a batch job's requests (app/window/batch_panel.py)
            return batch
        chat = ChatTitler.chat_of(session_id)
        if chat is not None:  # the request that names a chat (app/chat/titler.py)
            named = self.chat_title(chat)
            return f"Title for {named}" if named else None
        session = self.manager.sessions.get(session_id)
        return session.title if session is not None else None

    def chat_color(self, session_id: str) -> QColor:
        return colors.accent_color(ChatTitler.chat_of(session_id) or session_id)

    def queued_sessions(self) -> dict[str, float]:
        """Local chats with a reply asked for, by session id, and when (time.time()): the
        monitor shows them "waiting" until the engine's snapshot has taken them in."""
        return {sid: s.sent_at for sid, s in self.manager.sessions.items()
                if s.busy and not s.is_remote}

    def focus_chat(self, session_id: str) -> bool:
        return self.deck.focus_chat(session_id)

    def remote_sessions(self) -> dict[str, Any]:
        """Monitor rows for the open remote chats: "remote", no blocks of this pool."""
        ids = [sid for sid, s in self.manager.sessions.items() if s.is_remote
               and (s.busy or self.pane_for(sid) is not None)]
        return self.remote.stats(ids)

    # ---- panes ---------------------------------------------------------------------------

    @property
    def panes(self) -> list[ChatPane]:
        return self.deck.panes

    @property
    def focused_pane(self) -> ChatPane | None:
        return self.deck.focused

    def pane_for(self, conversation_id: str) -> ChatPane | None:
        return self.deck.pane_for(conversation_id)

    def focus_pane(self, i: int) -> None:
        self.deck.focus(i)

    def close_focused_pane(self) -> None:
        if self.focused_pane is not None:
            self.deck.close(self.focused_pane)

    def _pane_focused(self, pane: ChatPane) -> None:
        # The chat in front of the user goes first; the other panes' chats yield (§3.3).
        session = pane.session
        local = session is not None and not session.is_remote
        self.bridge.set_focus(session.id if local else None)
        if pane.session is not None:
            self.sidebar.select(pane.session.id)
            self.setWindowTitle(f"{pane.session.title} — {APP_NAME}")

    def _pane_count_changed(self, n: int) -> None:
        for i in range(MAX_PANES):
            self.actions_by_key[f"focus_{i}"].setEnabled(i < n)
        self.act_new_pane.setEnabled(n < MAX_PANES)
        self.act_close_pane.setEnabled(n > 1)
        self.compare_bar.set_pane_count(n)

    def open_chat(self, conversation_id: str, new_pane: bool = False) -> ChatPane | None:
        """Show a chat: focus its pane if open, else in a new pane or the focused one."""
        existing = self.pane_for(conversation_id)
        session = existing.session if existing else self.manager.get(conversation_id)
        if session is None:
            self.statusBar().showMessage("That chat no longer exists.", 5000)
            return None
        pane, previous = self.deck.open(session, new_pane)
        if existing is None:
            if previous is not None and self.pane_for(previous.id) is None:
                self.manager.discard_if_unused(previous)
            self._save_soon()
        return pane

    def new_chat(self, new_pane: bool = False, folder_id: str | None = None) -> ChatPane | None:
        """A new chat, in the folder given or else the one the sidebar shows."""
        if new_pane and len(self.panes) >= MAX_PANES:
            self.statusBar().showMessage(f"At most {MAX_PANES} panes side by side.", 5000)
            return None
        if folder_id is None:
            shown = self.sidebar.folders.view.current_folder()
            folder_id = None if shown == ALL_FOLDERS else shown
        # an empty one it replaces is dropped (open_chat)
        session = self.manager.create(folder_id=folder_id)
        return self.open_chat(session.id, new_pane=new_pane)

    def new_incognito_chat(self) -> ChatPane | None:
        """An incognito chat in the focused pane (app/chat/incognito.py): never saved, its
        memory never shared nor written to disk; it ends when its pane shows another chat or
        closes."""
        session = self.manager.create_incognito()
        return self.open_chat(session.id)

    # ---- chat commands -------------------------------------------------------------------

    def send_to_all(self, text: str) -> int:
        """Send `text` to every open pane (compare mode); returns how many accepted it."""
        if not text.strip():
            self.statusBar().showMessage("Type a message first.", 4000)
            return 0
        return self.deck.send_to_all(text)

    def _compare_submit(self, text: str) -> None:
        if self.send_to_all(text):
            self.compare_bar.input.clear()

    def toggle_compare(self, checked: bool | None = None) -> None:
        """Send to All (the action): with a message typed, send it to every pane; else show
        or hide the bar to type one (Esc in the bar hides it)."""
        if checked is None and self._send_draft_to_all():
            self.act_send_all.setChecked(self.compare_bar.isVisible())  # a send, not a toggle
            return
        on = self.act_send_all.isChecked() if checked is None else bool(checked)
        had_focus = self.compare_bar.isAncestorOf(QApplication.focusWidget())
        self.act_send_all.setChecked(on)
        self.compare_bar.setVisible(on)
        if on:
            self.compare_bar.input.setFocus()
        elif had_focus and self.focused_pane is not None:
            self.focused_pane.focus_input()

    def _send_draft_to_all(self) -> bool:
        """The draft already typed goes to every pane (it was left behind while an empty bar
        opened, issue 25): the bar's own when it has the focus, else the focused pane's.
        False when there is no draft."""
        bar = self.compare_bar.input
        if bar.hasFocus() and bar.toPlainText().strip():
            self._compare_submit(bar.toPlainText())
            return True
        pane = self.focused_pane
        if pane is None or pane.session is None or not pane.input.toPlainText().strip():
            return False
        was_busy = pane.session.busy
        self.send_to_all(pane.input.toPlainText())
        if not was_busy and pane.session.busy:  # its own pane took it: the box is emptied
            pane.input.clear()
        return True

    def stop_all(self) -> None:
        for s in list(self.manager.sessions.values()):
            s.stop()

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
        self.sidebar.focus_search()

    def rename_focused_chat(self) -> None:
        pane = self.focused_pane
        if pane is not None and pane.session is not None:
            self.sidebar.start_rename(pane.session.id)

    def delete_focused_chat(self) -> None:
        if self.focused_pane is not None and self.focused_pane.session is not None:
            self.delete_chat(self.focused_pane.session.id)

    def delete_chat(self, conversation_id: str, confirm: bool = True) -> bool:
        conv = self.store.get_conversation(conversation_id)
        if conv is None:
            return False
        if confirm and not confirm_destructive(
            self,
            "Delete Chat",
            f"Delete “{conv.title}” and all its messages? This cannot be undone.",
        ):
            return False
        self.context_watch.forget(conversation_id)  # its blocks no other chat shares
        self.manager.delete(conversation_id)
        self.deck.drop_chat(conversation_id, self.manager.latest_or_new)
        self._save_soon()
        return True

    # ---- the library: search hits, export and import (app/library/dialogs.py) ------------

    def show_hit(self, conversation_id: str, message_id: str | None) -> None:
        """A search hit: its chat in a pane (the focused one unless open), at the message."""
        pane = self.open_chat(conversation_id)
        if pane is not None and message_id is not None:
            pane.reveal_message(message_id)

    def toggle_sidebar(self, checked: bool | None = None, by_user: bool = True) -> None:
        on = self.act_sidebar.isChecked() if checked is None else bool(checked)
        self.act_sidebar.setChecked(on)
        self.sidebar.setVisible(on)
        fitter = getattr(self, "dock_fitter", None)  # (made after the layout is restored)
        if by_user and fitter is not None:
            fitter.sidebar_set_by_user(on)

    def show_shortcuts(self) -> None:
        """Help ▸ Keyboard Shortcuts, read off this window's actions as they are now."""
        dialog = ShortcutsDialog(shortcut_rows(self.actions_by_key), self)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.open()  # window-modal, no nested event loop

    def about(self) -> None:
        QMessageBox.about(
            self,
            "About PagedChat",
            "<b>PagedChat</b><br/>Several local-LLM chats side by side, streaming at once "
            "from one engine whose KV caches share a paged block pool.",
        )

    # ---- theme and chats list ------------------------------------------------------------

    def _theme_changed(self, _dark: bool) -> None:
        refresh_icons(self.actions_by_key)
        self.model_button.refresh_icon()
        self.sidebar.refresh_icons()
        for p in self.panes:
            p.refresh_icons()

    def _conversations_changed(self) -> None:
        self.sidebar.reload()
        if self.focused_pane is not None and self.focused_pane.session is not None:
            self.sidebar.select(self.focused_pane.session.id)
        if self.focused_pane is not None and self.focused_pane.session is not None:
            self.setWindowTitle(f"{self.focused_pane.session.title} — {APP_NAME}")

    # ---- layout persistence --------------------------------------------------------------

    def _save_soon(self) -> None:
        QTimer.singleShot(0, self, self.save_layout)

    def save_layout(self) -> None:
        if self._closed:
            return
        self.store.set_value(
            LAYOUT_KEY,
            {
                "geometry": to_b64(self.saveGeometry()),
                "state": to_b64(self.saveState()),
                "main_splitter": to_b64(self.main_splitter.saveState()),
                **self.deck.state(),
                "sidebar": self._sidebar_wanted(),
                "compare": self.act_send_all.isChecked(),
            },
        )

    def _sidebar_wanted(self) -> bool:
        """Saved as shown unless the user hid it (stepping aside for room is not a choice)."""
        fitter = getattr(self, "dock_fitter", None)
        if not self.isVisible() or (fitter is not None and fitter.sidebar_auto_hidden):
            return True
        return self.sidebar.isVisibleTo(self)

    def restore_layout(self) -> None:
        layout = self.store.get_value(LAYOUT_KEY, {}) or {}
        if not isinstance(layout, dict):
            layout = {}
        self.restoreGeometry(from_b64(layout.get("geometry")))
        self.restoreState(from_b64(layout.get("state")))
        self.main_splitter.restoreState(from_b64(layout.get("main_splitter")))
        self.manager.prune_empty(keep=set(PaneDeck.saved_chats(layout)))
        self.deck.restore(layout, self.manager.get, self.manager.latest_or_new)
        if layout.get("sidebar") is False:
            self.toggle_sidebar(False)
        if layout.get("compare"):
            self.toggle_compare(True)
        self.sidebar.reload()

    # ---- quitting ------------------------------------------------------------------------

    def quit(self) -> None:
        self._quitting = True
        self.close()
        QApplication.quit()

    def shutdown_chats(self) -> None:
        """Cancel every reply, keeping partial text marked interrupted; save the layout."""
        self.save_layout()
        self.server_panel.shutdown()
        self.titler.close()  # a title answered after this would write to a closed store
        self.batch_panel.shutdown()
        self.manager.interrupt_all()
        self.tools.close()
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


