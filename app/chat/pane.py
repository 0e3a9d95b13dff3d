"""A chat pane: header, message list, composer and the stats footer for one chat.

A pane is only a view on a ChatSession (which keeps streaming if the pane closes). It carries
out message actions (copy, edit, regenerate, branch, switch alternative), shows notices for
refused input, and renders the footer from the engine's pool snapshot: tokens/s, context used
of the model's limit, and the KV blocks the chat holds and shares.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QEvent, QObject, QRect, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QGuiApplication, QKeyEvent, QPainter, QPaintEvent
from PySide6.QtWidgets import (
    QDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat.attachment_bar import AttachmentBar
from app.chat.chat_settings_dialog import ChatSettingsDialog
from app.chat.draft_meter import DraftMeter
from app.chat.input_box import InputBox
from app.chat.message_model import ChatMessageModel
from app.chat.message_view import MessageListView
from app.chat.model_selector import ModelSelector
from app.chat.session import ChatSession
from app.core.model_names import model_id
from app.core.prefill_eta import PrefillEta
from app.core.rates import fmt_rate, shown_rate
from app.core.records import Status
from app.ui import colors, icons
from app.ui.elided_label import ElidedLabel, wrapped_lines
from app.ui.qt_util import disconnect
from engine import EngineStatus

NOTICE_MS = 8000
TITLE_LINES = 3  # a longer title ends in "…" on its last line (the tooltip has it whole)
DOT_ROOM = 18  # px left of the title for the header's accent dot


def _fmt_int(n: int) -> str:
    return f"{n:,}"


class PaneHeader(QWidget):
    """Accent dot + title + per-pane buttons; paints the accent bar of a focused pane."""

    def __init__(self, parent: QWidget) -> None:
        super().__init__(parent)
        self.setObjectName("paneHeader")
        self.accent = QColor("#888")
        self.focused = False
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)

    def dot_rect(self) -> QRect:
        """The accent dot, beside the title's first line (the title may wrap)."""
        top = self.contentsMargins().top() + self.layout().contentsMargins().top()
        return QRect(12, top + 7, 10, 10)

    def paintEvent(self, event: QPaintEvent) -> None:
        super().paintEvent(event)
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(self.accent)
        p.drawEllipse(self.dot_rect())
        c = QColor(self.accent)
        c.setAlphaF(1.0 if self.focused else 0.35)
        p.setBrush(c)
        p.drawRect(QRect(0, 0, self.width(), 3))
        p.end()


class ChatPane(QFrame):
    focusedIn = Signal(object)  # this pane
    closeRequested = Signal(object)
    branchRequested = Signal(object, str)  # session, message id
    settingsChanged = Signal(str)  # session id

    def __init__(self, session: ChatSession, bridge: Any, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("chatPane")
        self.bridge = bridge
        self.session: ChatSession | None = None
        self.model: ChatMessageModel | None = None
        self._editing: str | None = None  # user message id being edited
        self._number = 0
        self._prefill_eta = PrefillEta()  # how long the prompt being read still takes
        self._build()
        self.set_session(session)
        bridge.snapshotUpdated.connect(self._on_snapshot)
        bridge.statusChanged.connect(self._update_footer)
        bridge.modelReady.connect(self._on_model_ready)

    # ---- construction --------------------------------------------------------------------

    def _build(self) -> None:
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)

        # The title wraps at word boundaries (up to TITLE_LINES lines) beside the buttons;
        # the model and the system prompt each have a row of the header's whole width, so
        # four panes and the monitor at 1280 px cut neither (they read "What i…", "Local").
        self.header = PaneHeader(self)
        h = QVBoxLayout(self.header)
        h.setContentsMargins(12, 6, 6, 6)
        h.setSpacing(2)
        first = QHBoxLayout()
        first.setContentsMargins(0, 0, 0, 0)
        first.setSpacing(2)
        first.addSpacing(DOT_ROOM)
        self.title_label = QLabel()
        self.title_label.setObjectName("paneTitle")
        self.title_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.title_label.setAccessibleName("Chat title")
        first.addWidget(self.title_label, 1)
        self.settings_button = self._tool_button("sliders", "Chat settings", self.open_settings)
        self.close_button = self._tool_button("close", "Close pane", self._close_clicked)
        first.addWidget(self.settings_button, 0, Qt.AlignmentFlag.AlignTop)
        first.addWidget(self.close_button, 0, Qt.AlignmentFlag.AlignTop)
        h.addLayout(first)
        self.model_selector = ModelSelector(self)
        self.model_selector.modelPicked.connect(self._model_picked)
        model_row = QHBoxLayout()
        model_row.setContentsMargins(0, 0, 0, 0)
        model_row.addWidget(self.model_selector, 1)
        model_row.addStretch(0)
        h.addLayout(model_row)
        self.subtitle_label = QLabel()
        self.subtitle_label.setObjectName("paneSubtitle")
        self.subtitle_label.setSizePolicy(
            QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred
        )
        h.addWidget(self.subtitle_label)
        layout.addWidget(self.header)

        self.view = MessageListView(self)
        self.view.actionRequested.connect(self._on_action)
        self.view.regenerateMany.connect(self.regenerate)
        layout.addWidget(self.view, 1)

        self.empty_label = QLabel(
            "Ask anything.\nEnter sends · Shift+Enter adds a line", self.view.viewport()
        )
        self.empty_label.setObjectName("emptyState")
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty_label.setAttribute(Qt.WidgetAttribute.WA_TransparentForMouseEvents)
        self.empty_label.setWordWrap(True)  # narrow panes wrap the hint instead of cutting it
        self.empty_label.setContentsMargins(8, 8, 8, 8)
        # it floats over the viewport (not in a layout): follow the viewport's own resizes,
        # which come after the pane's (the pane's resize alone left it at a stale size)
        self.view.viewport().installEventFilter(self)

        self.notice_label = QLabel()
        self.notice_label.setObjectName("paneNotice")
        self.notice_label.setWordWrap(True)
        self.notice_label.setAccessibleName("Notice")
        self.notice_label.hide()
        layout.addWidget(self.notice_label)
        self._notice_timer = QTimer(self)
        self._notice_timer.setSingleShot(True)
        self._notice_timer.timeout.connect(self.notice_label.hide)

        self.edit_banner = QLabel(
            "Editing a message: Enter resends it as a new branch · Esc cancels"
        )
        self.edit_banner.setObjectName("editBanner")
        self.edit_banner.setWordWrap(True)
        self.edit_banner.hide()
        layout.addWidget(self.edit_banner)

        # a tool call waiting for the user's answer (ChatSession.toolAsk)
        self.tool_bar = QFrame()
        self.tool_bar.setObjectName("toolApproval")
        self.tool_bar.setAccessibleName("Tool call approval")
        tb = QVBoxLayout(self.tool_bar)
        tb.setContentsMargins(12, 6, 12, 6)
        self.tool_label = QLabel()
        self.tool_label.setWordWrap(True)
        self.tool_label.setAccessibleName("Tool call")
        self.tool_label.setTextFormat(Qt.TextFormat.PlainText)
        tb.addWidget(self.tool_label)
        buttons = QHBoxLayout()
        self.allow_once_button = QPushButton("Allow &once")
        self.allow_always_button = QPushButton("&Always for this tool")
        self.deny_button = QPushButton("&Deny")
        for b, decision in ((self.allow_once_button, "once"),
                            (self.allow_always_button, "always"), (self.deny_button, "deny")):
            b.setAccessibleName(b.text().replace("&", "") + " (tool call)")
            b.clicked.connect(lambda _c=False, d=decision: self._answer_tool(d))
            buttons.addWidget(b)
        buttons.addStretch(1)
        tb.addLayout(buttons)
        self.tool_bar.hide()
        layout.addWidget(self.tool_bar)

        composer = QFrame()
        composer.setObjectName("composer")
        c = QHBoxLayout(composer)
        c.setContentsMargins(10, 6, 6, 6)
        c.setSpacing(6)
        self.input = InputBox(composer)
        self.input.submitted.connect(self._submit)
        self.input.cancelled.connect(self._escape)
        c.addWidget(self.input, 1)
        self.send_button = QToolButton(composer)
        self.send_button.setObjectName("sendButton")
        self.send_button.setAccessibleName("Send message")
        self.send_button.setToolTip("Send (Enter)")
        self.send_button.setIconSize(icons.icon_size(16))
        self.send_button.setFixedSize(30, 30)
        self.send_button.clicked.connect(self._send_clicked)
        c.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        wrap = QWidget()
        wl = QVBoxLayout(wrap)
        wl.setContentsMargins(12, 4, 12, 2)
        wl.addWidget(composer)
        self.draft_meter = DraftMeter(wrap)  # the draft's tokens, flagged when too long
        self.draft_meter.draft = self.input.toPlainText
        self.draft_meter.prompt_for = self._draft_prompt
        self.draft_meter.count_tokens = self._count_draft
        self.draft_meter.limit = lambda: self.bridge.max_context
        self.draft_meter.context_used = lambda: getattr(self.session, "context_tokens", None)
        self.input.textChanged.connect(self.draft_meter.schedule)
        wl.addWidget(self.draft_meter)
        self.attachments = AttachmentBar(self)  # files for the next message (chips, tokens)
        self.attachments.notice.connect(self.show_notice)
        self.attachments.accept_drops_on(self.input.viewport())
        self.attachments.count_tokens = self.bridge.count_tokens
        self.attachments.context_left = self._context_left
        self.attachments.changed.connect(self.draft_meter.schedule)
        layout.addWidget(self.attachments)
        layout.addWidget(wrap)

        self.footer = ElidedLabel()
        self.footer.setObjectName("paneFooter")
        self.footer.setAccessibleName("Chat statistics")
        layout.addWidget(self.footer)

        for w in (self.input, self.view, self.send_button, self.settings_button, self.close_button):
            w.installEventFilter(self)
        self.title_label.installEventFilter(self)

    def _tool_button(self, icon_name: str, name: str, slot: Any) -> QToolButton:
        b = QToolButton(self)
        b.setIcon(icons.icon(icon_name, size=16))
        b.setIconSize(icons.icon_size(16))
        b.setAccessibleName(name)
        b.setToolTip(name)
        b.setAutoRaise(True)
        b.setFocusPolicy(Qt.FocusPolicy.TabFocus)
        b.clicked.connect(slot)
        b.setProperty("icon_name", icon_name)
        return b

    def refresh_icons(self) -> None:
        for b in (self.settings_button, self.close_button):
            b.setIcon(icons.icon(b.property("icon_name"), size=16))
        self.attachments.refresh_icon()
        self._update_busy()

    # ---- session binding -----------------------------------------------------------------

    def set_session(self, session: ChatSession) -> None:
        if self.session is session:
            return
        if self.session is not None:
            self._disconnect_session(self.session)
        if self.model is not None:
            self.model.detach()
        self.cancel_edit()
        self.session = session
        self.model = ChatMessageModel(session, parent=self)
        self.view.setModel(self.model)
        session.titleChanged.connect(self._update_title)
        session.busyChanged.connect(self._update_busy)
        session.notice.connect(self.show_notice)
        session.contextChanged.connect(self._update_footer)
        session.pathChanged.connect(self._update_empty)
        session.settingsChanged.connect(self._update_title)
        session.modelChanged.connect(self._model_changed)
        session.toolAsk.connect(self._show_tool_ask)
        self._watch_registry(session)
        self.header.accent = colors.accent_color(session.id)
        self.header.update()  # the dot and the accent bar are painted, not styled
        session.contextChanged.connect(self.draft_meter.schedule)
        self._update_title()
        self._update_busy()
        self._update_empty()
        self._update_footer()
        self.draft_meter.schedule()
        self._show_tool_ask(session.awaiting_tool or "")

    def _disconnect_session(self, session: ChatSession) -> None:
        for sig, slot in (
            (session.titleChanged, self._update_title),
            (session.busyChanged, self._update_busy),
            (session.notice, self.show_notice),
            (session.contextChanged, self._update_footer),
            (session.pathChanged, self._update_empty),
            (session.settingsChanged, self._update_title),
            (session.modelChanged, self._model_changed),
            (session.contextChanged, self.draft_meter.schedule),
            (session.toolAsk, self._show_tool_ask),
        ):
            disconnect(sig, slot)

    # ---- the chat's model ----------------------------------------------------------------

    def _watch_registry(self, session: ChatSession) -> None:
        remote = session.remote
        registry = getattr(remote, "registry", None)
        if registry is not None and not getattr(self, "_registry_watched", False):
            self._registry_watched = True
            registry.add_listener(self.refresh_models)
            remote.activityChanged.connect(self._remote_activity)
        self.refresh_models()

    def refresh_models(self) -> None:
        """Re-list the models (providers or their lists changed; the local model loaded)."""
        if self.session is None:
            return
        remote = self.session.remote
        info = self.bridge.model_info
        local = model_id(getattr(info, "name", None) or "engine model")
        self.model_selector.fill(getattr(remote, "registry", None), str(local),
                                 self.session.model_ref)
        self._update_title()

    def _on_model_ready(self, _info: object) -> None:
        self.refresh_models()

    def _model_picked(self, ref: str) -> None:
        if self.session is not None and not self.session.set_model(ref):
            self.refresh_models()  # refused (still answering): show the model it keeps

    def _model_changed(self, _ref: str) -> None:
        self.refresh_models()
        self._update_footer()

    def _remote_activity(self, session_id: str) -> None:
        if self.session is not None and session_id == self.session.id:
            self._update_footer()

    def model_label(self) -> str:
        """The chat's model as the header shows it."""
        return self.model_selector.currentText()

    def detach(self) -> None:
        """Called before the pane is deleted: stop listening (the session lives on)."""
        if self.session is not None:
            self._disconnect_session(self.session)
        if self.model is not None:
            self.model.detach()
        self.view.setModel(None)  # the view stops listening to the model before both go
        for sig, slot in (
            (self.bridge.snapshotUpdated, self._on_snapshot),
            (self.bridge.statusChanged, self._update_footer),
            (self.bridge.modelReady, self._on_model_ready),
        ):
            disconnect(sig, slot)
        remote = self.session.remote if self.session is not None else None
        if getattr(self, "_registry_watched", False) and remote is not None:
            remote.registry.remove_listener(self.refresh_models)
            disconnect(remote.activityChanged, self._remote_activity)
            self._registry_watched = False

    def set_number(self, n: int) -> None:
        """1-based position in the workspace (for Ctrl/⌘+n and accessible names)."""
        self._number = n
        self._update_title()

    def set_focused(self, focused: bool) -> None:
        self.header.focused = focused
        self.setProperty("focused", focused)
        self.style().unpolish(self)
        self.style().polish(self)
        self.header.update()

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.MouseButtonDblClick and obj is self.send_button:
            # Send turns into Stop under the pointer, as in Mac chat apps (one target that
            # never moves). The second click of a double click (the system's interval and
            # distance) is therefore no click here: it would stop the reply the first click
            # just started (issue 25). A deliberate click on Stop works as always.
            self.send_button.setDown(False)
            return True
        if event.type() == QEvent.Type.Resize and obj is self.view.viewport():
            self.empty_label.setGeometry(self.view.viewport().rect())
        if event.type() == QEvent.Type.Resize and obj is self.title_label:
            self._update_title()  # wrapped anew at the label's own width (set after the pane's)
        if event.type() == QEvent.Type.FocusIn:
            self.focusedIn.emit(self)
        return False

    def mousePressEvent(self, event: Any) -> None:
        self.focusedIn.emit(self)
        super().mousePressEvent(event)

    # ---- actions -------------------------------------------------------------------------

    def focus_input(self) -> None:
        self.input.setFocus(Qt.FocusReason.ShortcutFocusReason)

    def send(self, text: str) -> bool:
        """Send `text` as the user (what Enter does); returns whether it was accepted."""
        assert self.session is not None
        self.notice_label.hide()  # an old notice; a new one may come from this send
        if self._editing is None and self.draft_meter.too_long(text):
            self.show_notice("This message is longer than the model's context: shorten it "
                             "(or start a new chat) before sending.")
            return False
        if self._editing is not None:
            mid, self._editing = self._editing, None
            self.edit_banner.hide()
            ok = self.session.edit_and_resend(mid, text)
        else:
            ok = self.session.send(text, self.attachments.pending)
            if ok:
                self.attachments.take()
        if ok:
            self.input.clear()
            self.view.scrollToBottom()
        return ok

    def _submit(self, text: str) -> None:
        if self.session is not None and self.session.busy:
            self.show_notice("This chat is still answering: stop it (or wait) before sending.")
            return
        self.send(text)

    def _send_clicked(self) -> None:
        if self.session is not None and self.session.busy:
            self.session.stop()
        else:
            self._submit(self.input.toPlainText())
        self.focus_input()

    def stop(self) -> None:
        if self.session is not None:
            self.session.stop()

    def regenerate(self, message_id: str | None = None, n: int = 1) -> bool:
        return self.session.regenerate(message_id, n) if self.session is not None else False

    def start_edit(self, message_id: str) -> None:
        assert self.session is not None
        msg = self.session.tree.get(message_id)
        self._editing = message_id
        self.input.setPlainText(msg.content)
        self.edit_banner.show()
        self.focus_input()
        cursor = self.input.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        self.input.setTextCursor(cursor)

    def reveal_message(self, message_id: str) -> bool:
        """Show a message (a search hit): its branch, selected and scrolled to the top. The
        scroll waits for the event loop's turn, after the view's own scroll to the bottom
        that a newly shown chat queues."""
        if self.session is None or not self.session.show_branch(message_id):
            return False

        def scroll() -> None:
            if self.model is not None:
                self.view.scroll_to_row(self.model.row_of(message_id))

        QTimer.singleShot(0, self, scroll)
        return True

    def _draft_prompt(self, text: str) -> list[dict]:
        return self.session.draft_prompt(text, self.attachments.pending) if self.session else []

    async def _count_draft(self, messages: list[dict]) -> int | None:
        """The local engine's count (a remote chat's server tokenizes its own way: none)."""
        if self.session is None or self.session.is_remote:
            return None
        return await self.bridge.count_tokens(messages)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        """Esc anywhere in the pane (the message list, a button) does what it does in the
        message box: cancel an edit, else stop the reply. Keys reach the pane only when the
        focused child did not use them."""
        if event.key() == Qt.Key.Key_Escape and event.modifiers() == Qt.KeyboardModifier.NoModifier:
            self._escape()
            event.accept()
            return
        super().keyPressEvent(event)

    def _context_left(self) -> int | None:
        """Tokens the model's context has left after the chat so far (None: not known)."""
        limit = self.bridge.max_context
        used = self.session.context_tokens if self.session is not None else None
        return None if not limit or used is None else max(0, limit - used)

    def _escape(self) -> None:
        if self._editing is not None:
            self.cancel_edit()
        elif self.session is not None and self.session.busy:
            self.session.stop()

    def cancel_edit(self) -> None:
        if self._editing is not None:
            self._editing = None
            self.input.clear()
        self.edit_banner.hide()

    def _on_action(self, message_id: str, action: str) -> None:
        session = self.session
        if session is None or message_id not in session.tree:
            return
        msg = session.tree.get(message_id)
        if action == "copy":
            QGuiApplication.clipboard().setText(msg.content)
        elif action == "edit":
            if session.busy:
                self.show_notice("Stop the reply before editing.")
            else:
                self.start_edit(message_id)
        elif action == "regenerate":
            session.regenerate(message_id, 1)
        elif action == "branch":
            if msg.status in Status.LIVE:
                self.show_notice("Wait for the reply to finish before branching from it.")
            else:
                self.branchRequested.emit(session, message_id)
        elif action in ("prev", "next"):
            session.switch_alternative(message_id, -1 if action == "prev" else 1)

    def open_settings(self) -> None:
        if self.session is None:
            return
        manager = self.session.manager
        dialog = ChatSettingsDialog(
            self.session.title,
            self.session.settings,
            self,
            defaults=getattr(getattr(manager, "default_settings", None), "sampling", None),
            defaults_source=getattr(manager, "default_source", ""),
        )
        if dialog.exec() == QDialog.DialogCode.Accepted:
            self.session.set_settings(dialog.value())
            self.settingsChanged.emit(self.session.id)

    def _show_tool_ask(self, message_id: str) -> None:
        """Show (or, for "", hide) the question about a tool call: which tool, which
        server, with what arguments."""
        session = self.session
        if not message_id or session is None or message_id not in session.tree:
            self.tool_bar.hide()
            return
        meta = session.tree.get(message_id).meta
        call = meta.get("tool_call") or {}
        server = f" (server {meta['server']})" if meta.get("server") else ""
        arguments = call.get("arguments", "")
        if len(arguments) > 600:
            arguments = arguments[:600] + "…"
        tool = meta.get("tool") or call.get("name", "")
        self.tool_label.setText(f"The model wants to call {tool}{server} with {arguments}")
        self.tool_bar.show()

    def _answer_tool(self, decision: str) -> None:
        session = self.session
        if session is not None and session.awaiting_tool is not None:
            session.answer_tool(session.awaiting_tool, decision)

    def _close_clicked(self) -> None:
        self.closeRequested.emit(self)

    def show_notice(self, text: str) -> None:
        self.notice_label.setText(text)
        self.notice_label.show()
        self._notice_timer.start(NOTICE_MS)

    # ---- display -------------------------------------------------------------------------

    def _update_title(self, *_args: object) -> None:
        if self.session is None:
            return
        title = self.session.title
        lines, _cut = wrapped_lines(title, self.title_label.font(),
                                    max(60, self.title_label.width()), TITLE_LINES)
        text = "\n".join(lines)
        if text != self.title_label.text():
            self.title_label.setText(text)
        self.title_label.setToolTip(title)
        prompt = " ".join(self.session.settings.system_prompt.split())
        sub = self.subtitle_label
        if prompt:
            sub.setText(
                sub.fontMetrics().elidedText(
                    f"System: {prompt}", Qt.TextElideMode.ElideRight, max(60, sub.width())
                )
            )
            sub.setToolTip(self.session.settings.system_prompt)
        sub.setVisible(bool(prompt))
        prefix = f"Pane {self._number}: " if self._number else ""
        self.setAccessibleName(f"{prefix}{title}")

    def resizeEvent(self, event: Any) -> None:
        super().resizeEvent(event)
        self._update_title()
        self.empty_label.setGeometry(self.view.viewport().rect())

    def _update_busy(self, *_args: object) -> None:
        busy = self.session is not None and self.session.busy
        self.send_button.setIcon(icons.icon("stop" if busy else "send", QColor("#ffffff"), 16))
        self.send_button.setAccessibleName("Stop generating" if busy else "Send message")
        self.send_button.setToolTip("Stop (Esc)" if busy else "Send (Enter)")
        self.send_button.setProperty("busy", busy)
        self.send_button.style().unpolish(self.send_button)
        self.send_button.style().polish(self.send_button)
        self._update_footer()

    def _update_empty(self) -> None:
        has = self.model is not None and self.model.rowCount() > 0
        self.empty_label.setVisible(not has)
        self.empty_label.setGeometry(self.view.viewport().rect())

    def _on_snapshot(self, snapshot: Any) -> None:
        self._update_footer()
        if self.model is None or self.session is None:
            return
        stats = snapshot.sessions.get(self.session.id) if snapshot is not None else None
        total = getattr(stats, "prompt_tokens_total", 0) if self.session.busy else 0
        if stats is None or not total:
            self._prefill_eta.reset()
            self.model.set_prompt_progress(None)
            return
        done = stats.prompt_tokens_done
        self.model.set_prompt_progress(
            (done, total), self._prefill_eta.update(snapshot.time, done, total))

    def _update_remote_footer(self) -> None:
        s = self.footer_stats()
        tps = f"{s['tokens_per_s']:.1f} tok/s" if s["tokens_per_s"] else "— tok/s"
        ctx = _fmt_int(s["context"]) if s["context"] else "—"
        text = f"{tps}   ·   {ctx} tokens   ·   remote: no local KV blocks"
        if text != self.footer.text():
            self.footer.setText(text)
            self.footer.setToolTip(
                f"{text}\n\nSpeed of the provider's stream · tokens in context (the server's"
                " own count, from its last reply) · a remote chat holds no blocks of this pool")

    def footer_stats(self) -> dict[str, Any]:
        """What the footer shows, as numbers (tests read this)."""
        session = self.session
        if session is not None and session.is_remote:
            remote = session.remote
            live = remote.tokens_per_s(session.id) if (remote and session.busy) else 0.0
            usage = session.last_usage
            return {
                "tokens_per_s": live or (usage.get("decode_tokens_per_s") if usage else None),
                "context": session.context_tokens,
                "max_context": None,
                "blocks_held": 0,
                "blocks_shared": 0,
                "remote": True,
            }
        snap = self.bridge.latest_snapshot
        stats = snap.sessions.get(session.id) if (snap is not None and session) else None
        out: dict[str, Any] = {
            "tokens_per_s": None,
            "context": session.context_tokens if session else None,
            "max_context": self.bridge.max_context,
            "blocks_held": 0,
            "blocks_shared": 0,
        }
        if stats is not None:
            out["blocks_held"] = stats.blocks_held
            out["blocks_shared"] = stats.blocks_shared
            # the monitor's figure for this chat, from the same snapshot (app/core/rates.py)
            out["tokens_per_s"] = shown_rate(stats.tokens_per_s, stats.state)
            if session is not None and session.busy and stats.tokens_in_context:
                # summed over the samples of an n>1 request
                out["context"] = stats.tokens_in_context // max(1, session.live_samples())
        return out

    def _update_footer(self, *_args: object) -> None:
        if self.session is None:
            return
        if self.session.is_remote:
            self._update_remote_footer()
            return
        if self.bridge.status == EngineStatus.LOADING:
            self.footer.setText("Loading model…")
            return
        if self.bridge.status == EngineStatus.ERROR:
            self.footer.setText("Model not loaded")
            return
        s = self.footer_stats()
        tps = f"{fmt_rate(s['tokens_per_s'])} tok/s"
        ctx = _fmt_int(s["context"]) if s["context"] is not None else "—"
        limit = _fmt_int(s["max_context"]) if s["max_context"] else "—"
        blocks = f"{s['blocks_held']} blocks"
        if s["blocks_shared"]:
            blocks += f" · {s['blocks_shared']} shared"
        text = f"{tps}   ·   {ctx} / {limit} tokens   ·   {blocks}"
        if text != self.footer.text():
            self.footer.setText(text)
            self.footer.setToolTip(
                f"{text}\n\nTokens generated per second over the last 2 s (as in the monitor) · "
                "context used / context limit · KV blocks held by this chat (shared: also held "
                "by another sequence)"
            )
