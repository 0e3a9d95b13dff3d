"""The chat panes side by side: open, close, focus, number them, and keep the splitter's state.

One to MAX_PANES panes share a horizontal splitter; exactly one is focused (its chat is the
one commands act on). The deck also reports which pane's chat the pointer is over, the hover
the KV monitor highlights. It knows panes and sessions, not the window: the window listens to
its signals (focus moved, the number of panes changed, the layout changed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QEvent, QObject, Qt, Signal
from PySide6.QtWidgets import QSplitter, QWidget

from app.chat.pane import ChatPane
from app.chat.session import ChatSession
from app.ui.qt_util import from_b64, to_b64

MAX_PANES = 4


class PaneDeck(QObject):
    focusChanged = Signal(object)  # the focused ChatPane (again: it may show another chat)
    countChanged = Signal(int)  # panes open
    layoutChanged = Signal()  # panes or their widths changed: worth saving
    notice = Signal(str)  # something the user should read in the status bar
    branchRequested = Signal(object, str)  # session, message id
    chatHovered = Signal(object)  # session id of the pane under the pointer, or None

    def __init__(self, bridge: Any, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.panes: list[ChatPane] = []
        self.focused: ChatPane | None = None
        self._hovered: str | None = None
        self.splitter = QSplitter(Qt.Orientation.Horizontal, parent)
        self.splitter.setObjectName("paneSplitter")
        self.splitter.setChildrenCollapsible(False)
        self.splitter.setHandleWidth(1)
        self.splitter.splitterMoved.connect(lambda *_: self.layoutChanged.emit())

    # ---- panes ---------------------------------------------------------------------------

    def add(self, session: ChatSession) -> ChatPane:
        """A new pane for `session` at the right, all panes then of equal width."""
        pane = ChatPane(session, self.bridge, self.splitter)
        pane.focusedIn.connect(self.set_focused)
        pane.closeRequested.connect(self.close)
        pane.branchRequested.connect(self.branchRequested)
        pane.installEventFilter(self)
        self.splitter.addWidget(pane)
        self.panes.append(pane)
        self._renumber()
        self.splitter.setSizes([10_000] * len(self.panes))
        return pane

    def open(self, session: ChatSession, new_pane: bool = False) -> tuple[ChatPane, Any]:
        """Show a session and focus it: its pane if open, else a new pane (new_pane, or the
        first) or the focused one. Returns the pane and the session it no longer shows."""
        pane = self.pane_for(session.id)
        previous = None
        if pane is None and (not self.panes or (new_pane and len(self.panes) < MAX_PANES)):
            pane = self.add(session)
        elif pane is None:
            if new_pane:
                self.notice.emit(f"At most {MAX_PANES} panes: opened in the focused pane instead.")
            pane = self.focused or self.panes[-1]
            previous = pane.session
            pane.set_session(session)
        self.set_focused(pane)
        pane.focus_input()
        return pane, previous

    def send_to_all(self, text: str) -> int:
        """Send `text` to every pane that is free (compare mode); returns how many took it."""
        sent = 0
        for p in self.panes:
            if p.session is not None and p.session.busy:
                p.show_notice("Still answering: this pane did not get the message.")
                continue
            if p.session is not None and p.session.send(text):
                sent += 1
        return sent

    def close(self, pane: ChatPane) -> None:
        """Close a pane (never the last one); the pane at its place, else the last, gets focus.
        A reply streaming in it stops, tagged "Stopped" like any stop: closing the only view
        of a chat must not leave it generating unseen (issue 11)."""
        if pane not in self.panes or len(self.panes) <= 1:
            return
        if pane.session is not None and pane.session.busy:
            pane.session.stop()
        i = self.panes.index(pane)
        self.panes.remove(pane)
        pane.removeEventFilter(self)
        if pane.session is not None and pane.session.incognito and pane.session.manager:
            pane.session.manager.delete(pane.session.id)  # an incognito chat ends with its pane
        pane.detach()
        pane.hide()
        pane.setParent(None)
        pane.deleteLater()
        self._renumber()
        self.set_focused(self.panes[min(i, len(self.panes) - 1)])
        if self.focused is not None:
            self.focused.focus_input()
        self.layoutChanged.emit()

    def drop_chat(self, conversation_id: str, replacement: Callable[[], Any]) -> None:
        """A chat is gone: close its pane; the last pane shows `replacement()` instead."""
        pane = self.pane_for(conversation_id)
        if pane is None:
            return
        if len(self.panes) > 1:
            self.close(pane)
        else:
            pane.set_session(replacement())
            self.set_focused(pane)

    def focus(self, i: int) -> None:
        """Focus pane i (0-based), keyboard included; out of range does nothing."""
        if 0 <= i < len(self.panes):
            self.set_focused(self.panes[i])
            self.panes[i].focus_input()

    def focus_chat(self, session_id: str) -> bool:
        """Focus the pane showing this chat; False when none does."""
        pane = self.pane_for(session_id)
        if pane is not None:
            self.focus(self.panes.index(pane))
        return pane is not None

    def set_focused(self, pane: ChatPane) -> None:
        """Mark `pane` as the focused one; announced even when it already was, since the chat
        it shows may have changed (the sidebar follows it)."""
        if pane is not self.focused:
            self.focused = pane
            for p in self.panes:
                p.set_focused(p is pane)
        self.focusChanged.emit(pane)

    def pane_for(self, conversation_id: str) -> ChatPane | None:
        for p in self.panes:
            if p.session is not None and p.session.id == conversation_id:
                return p
        return None

    def sessions(self) -> list[ChatSession]:
        return [p.session for p in self.panes if p.session is not None]

    def _renumber(self) -> None:
        for i, p in enumerate(self.panes):
            p.set_number(i + 1)
            p.close_button.setEnabled(len(self.panes) > 1)
        self.countChanged.emit(len(self.panes))

    # ---- hover ---------------------------------------------------------------------------

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        kind = event.type()
        if kind == QEvent.Type.Enter and isinstance(obj, ChatPane):
            sid = obj.session.id if obj.session is not None else None
            if sid != self._hovered:
                self._hovered = sid
                self.chatHovered.emit(sid)
        elif kind == QEvent.Type.Leave and self._hovered is not None:
            self._hovered = None
            self.chatHovered.emit(None)
        return False

    # ---- layout --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What restores the deck: the chats in their panes, the focused one, the widths."""
        return {
            "pane_splitter": to_b64(self.splitter.saveState()),
            "panes": [s.id for s in self.sessions()],
            "focused": self.panes.index(self.focused) if self.focused in self.panes else 0,
        }

    @staticmethod
    def saved_chats(state: dict[str, Any]) -> list[str]:
        """The conversation ids a saved state opens (at most MAX_PANES)."""
        return [i for i in state.get("panes", []) if isinstance(i, str)][:MAX_PANES]

    def restore(
        self,
        state: dict[str, Any],
        session_of: Callable[[str], ChatSession | None],
        fallback: Callable[[], ChatSession | None],
    ) -> None:
        """Reopen the saved chats (one that is gone is skipped; none left: `fallback()`'s), the
        widths when every pane came back, and the focused pane."""
        ids = self.saved_chats(state)
        for cid in ids:
            session = session_of(cid)
            if session is not None and self.pane_for(cid) is None:
                self.add(session)
        if not self.panes:
            session = fallback()
            if session is not None:
                self.add(session)
        if len(self.panes) == len(ids):
            self.splitter.restoreState(from_b64(state.get("pane_splitter")))
        focused = state.get("focused", 0)
        valid = isinstance(focused, int) and 0 <= focused < len(self.panes)
        self.set_focused(self.panes[focused if valid else 0])
