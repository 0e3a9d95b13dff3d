"""The visible path of one chat as a Qt list model, with its rendered rich-text documents.

Rows are the messages of the session's active path. Each row's text is rendered to a
QTextDocument once and cached: a finished message is never rendered again (until the theme
changes); a streaming reply is re-rendered only when the shared RenderThrottle fires (at most
~30 Hz for all panes), and then only its open tail is parsed again (StreamingRenderer). Token
events merely append text and mark the model dirty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from typing import Any

from PySide6.QtCore import QAbstractListModel, QModelIndex, QObject, QPersistentModelIndex, Qt
from PySide6.QtGui import QFont, QTextDocument, QTextOption

from app.chat.attachment_bar import chips_html
from app.chat.markdown import Rendered, StreamingRenderer, plain_html, render_markdown
from app.chat.session import ChatSession
from app.chat.throttle import RenderThrottle, shared_throttle
from app.core.attachments import from_meta
from app.core.prefill_eta import time_left_text
from app.core.records import Message, Status
from app.ui.qt_util import disconnect
from app.ui.theme import MarkdownTheme, theme_manager

MessageRole = Qt.ItemDataRole.UserRole + 1
MessageIdRole = Qt.ItemDataRole.UserRole + 2

_ROLE_LABEL = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool"}
TOGGLE_SCHEME = "toggle:"  # the link that opens or closes a tool block
SUMMARY_CHARS = 140  # a closed tool block shows this much of its result


def _css(theme: MarkdownTheme) -> str:
    return (
        f"a {{ color: {theme.link}; text-decoration: none; }}"
        f"blockquote {{ color: {theme.quote_fg}; margin-left: 12px; }}"
        "p { margin-top: 0px; margin-bottom: 8px; }"
        "ul, ol { margin-top: 0px; margin-bottom: 8px; }"
        "h1 { font-size: x-large; } h2 { font-size: large; } h3 { font-size: medium; }"
        "code { font-family: monospace; }"
        "table { margin-bottom: 8px; }"
    )


@dataclass
class RenderEntry:
    """A message's rendered document and the source it was rendered from."""

    doc: QTextDocument
    code_blocks: tuple[str, ...]
    source: str
    status: str
    dark: bool
    width: float = -1.0
    ideal_width: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def layout(self, width: float) -> float:
        """Lay the document out at `width` (only if it changed); returns its height."""
        width = max(20.0, float(width))
        if self.width != width:
            self.doc.setTextWidth(width)
            self.width = width
            self.ideal_width = min(width, math.ceil(self.doc.idealWidth()))
        return math.ceil(self.doc.size().height())


class ChatMessageModel(QAbstractListModel):
    def __init__(
        self,
        session: ChatSession,
        throttle: RenderThrottle | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.session = session
        self.throttle = throttle or shared_throttle()
        self._ids: list[str] = [m.id for m in session.active_path()]
        self._entries: dict[str, RenderEntry] = {}
        self._streamers: dict[str, StreamingRenderer] = {}
        self._dirty: set[str] = set()
        self.font = QFont()
        self.prompt_progress: tuple[int, int] | None = None  # (read, total) while prefilling
        self._time_left: str | None = None  # "about 20 s left" once measured
        self.expanded: set[str] = set()  # tool messages shown whole (a click toggles)
        self.full_renders = 0  # finished messages rendered (each once)
        self.stream_renders = 0  # throttled re-renders of streaming tails
        session.pathChanged.connect(self._sync_rows)
        session.messageChanged.connect(self._on_grew)
        session.messageFinished.connect(self._on_finished)
        theme_manager().changed.connect(self._on_theme)

    # ---- Qt model API --------------------------------------------------------------------

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._ids)

    def data(
        self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole
    ) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._ids):
            return None
        msg = self.session.tree.get(self._ids[index.row()])
        if role == Qt.ItemDataRole.DisplayRole:
            return msg.content
        if role == Qt.ItemDataRole.AccessibleTextRole:
            return f"{_ROLE_LABEL.get(msg.role, msg.role)}: {msg.content or status_text(msg)}"
        if role == Qt.ItemDataRole.ToolTipRole:
            return None
        if role == MessageRole:
            return msg
        if role == MessageIdRole:
            return msg.id
        return None

    def flags(self, index: QModelIndex | QPersistentModelIndex) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable

    # ---- helpers for the view and delegate -----------------------------------------------

    def message(self, row: int) -> Message:
        return self.session.tree.get(self._ids[row])

    def set_prompt_progress(self, progress: tuple[int, int] | None,
                            seconds_left: float | None = None) -> None:
        """How much of the prompt the engine has read (from the pool snapshot) and, once
        measured, how long the rest takes: a long paste shows "Reading your message… 1,200
        / 3,648 tokens, about 20 s left" instead of a bare "Thinking…"."""
        left = time_left_text(seconds_left) if seconds_left is not None else None
        if (progress, left) == (self.prompt_progress, self._time_left):
            return
        self.prompt_progress, self._time_left = progress, left
        for row, mid in enumerate(self._ids):
            if self.session.tree.get(mid).status == Status.PENDING:
                self.dataChanged.emit(self.index(row), self.index(row))

    def waiting_text(self, msg: Message) -> str:
        """What a reply with no text yet shows."""
        p = self.prompt_progress
        if msg.status == Status.PENDING and p is not None and p[1] > 0:
            text = f"Reading your message… {p[0]:,} / {p[1]:,} tokens"
            return f"{text}, {self._time_left}" if self._time_left else text
        if msg.role == "tool":  # a tool call: asking the user, or the server at work
            state = msg.meta.get("state")
            if state == "asking":
                return f"Waiting for your answer: call {msg.meta.get('tool', 'the tool')}?"
            if state == "running":
                return f"Running {msg.meta.get('tool', 'the tool')}…"
        return "Thinking…"

    def message_ids(self) -> list[str]:
        return list(self._ids)

    def row_of(self, message_id: str) -> int:
        try:
            return self._ids.index(message_id)
        except ValueError:
            return -1

    def set_font(self, font: QFont) -> None:
        if font != self.font:
            self.font = QFont(font)
            self._entries.clear()
            self.layoutChanged.emit()

    def entry(self, row: int) -> RenderEntry:
        """The rendered document of a row (rendered now only if missing or out of date)."""
        msg = self.message(row)
        dark = theme_manager().dark
        e = self._entries.get(msg.id)
        live = msg.status in Status.LIVE
        if (
            e is not None
            and e.dark == dark
            and (live or (e.source == self._source(msg) and e.status == msg.status))
        ):
            return e  # a streaming entry is refreshed by flush_render, not here
        return self._render(msg, streaming=live)

    def toggle(self, row: int) -> None:
        """Open or close a tool block (its arguments and whole result)."""
        msg = self.message(row)
        self.expanded.symmetric_difference_update({msg.id})
        self._entries.pop(msg.id, None)
        self.layoutChanged.emit()  # the row's height changes

    def _source(self, msg: Message) -> str:
        """What a row's document is rendered from (a tool block also from its state)."""
        if msg.role != "tool":
            return msg.content
        return f"{msg.meta.get('state')}|{msg.id in self.expanded}|{msg.content}"

    def _render(self, msg: Message, streaming: bool) -> RenderEntry:
        theme = theme_manager().markdown_theme()
        if msg.role == "tool":
            rendered = Rendered(tool_html(msg, msg.id in self.expanded, theme))
        elif msg.role == "assistant" and not msg.content and msg.meta.get("tool_calls"):
            names = ", ".join(c["function"]["name"] for c in msg.meta["tool_calls"])
            rendered = Rendered(f"<p><i>Calls {escape(names)}</i></p>")
        elif msg.role != "assistant":
            rendered = Rendered(plain_html(msg.content))
        elif streaming:
            streamer = self._streamers.get(msg.id)
            if streamer is None or streamer.theme != theme:
                streamer = self._streamers[msg.id] = StreamingRenderer(theme)
            rendered = streamer.render(msg.content)
            self.stream_renders += 1
        else:
            rendered = render_markdown(msg.content, theme)
            self.full_renders += 1
        html = rendered.html
        files = from_meta(msg.meta)
        if files:  # the message's attachments as chips
            html += chips_html(files, theme.inline_code_bg)
        if msg.status == Status.ERROR and msg.meta.get("error"):
            html += f'<p style="color:#d64545;">{escape(sentence(str(msg.meta["error"])))}</p>'
        doc = QTextDocument()
        doc.setUndoRedoEnabled(False)
        doc.setDocumentMargin(0)
        doc.setDefaultFont(self.font)
        opt = QTextOption()
        opt.setWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        doc.setDefaultTextOption(opt)
        doc.setDefaultStyleSheet(_css(theme))
        doc.setHtml(html)
        e = RenderEntry(doc, rendered.code_blocks, self._source(msg), msg.status, theme.dark)
        self._entries[msg.id] = e
        return e

    # ---- session signals -----------------------------------------------------------------

    def _sync_rows(self) -> None:
        new = [m.id for m in self.session.active_path()]
        old = self._ids
        k = 0
        while k < min(len(old), len(new)) and old[k] == new[k]:
            k += 1
        if k < len(old):
            self.beginRemoveRows(QModelIndex(), k, len(old) - 1)
            self._ids = old[:k]
            self.endRemoveRows()
        if k < len(new):
            self.beginInsertRows(QModelIndex(), k, len(new) - 1)
            self._ids = new
            self.endInsertRows()
        self._ids = new
        if k > 0:  # alternative counters (‹ 1/2 ›) of earlier rows may have changed
            self.dataChanged.emit(self.index(0), self.index(k - 1))
        live = set(new)
        for mid in [m for m in self._entries if m not in live]:
            del self._entries[mid]
            self._streamers.pop(mid, None)

    def _on_grew(self, message_id: str) -> None:
        if message_id in self._ids:
            self._dirty.add(message_id)
            self.throttle.mark_dirty(self)

    def flush_render(self) -> None:
        """Re-render the dirty streaming tails (called by the shared throttle)."""
        dirty, self._dirty = self._dirty, set()
        for mid in dirty:
            row = self.row_of(mid)
            if row < 0:
                continue
            msg = self.message(row)
            if msg.status not in Status.LIVE:
                continue  # finished meanwhile: _on_finished rendered it
            self._render(msg, streaming=True)
            idx = self.index(row)
            self.dataChanged.emit(idx, idx)

    def _on_finished(self, message_id: str) -> None:
        self._dirty.discard(message_id)
        self._streamers.pop(message_id, None)
        self._entries.pop(message_id, None)
        row = self.row_of(message_id)
        if row >= 0:
            idx = self.index(row)
            self.dataChanged.emit(idx, idx)

    def _on_theme(self, _dark: bool) -> None:
        self._entries.clear()
        self._streamers.clear()
        self.layoutChanged.emit()

    def detach(self) -> None:
        """Stop listening to the session (the pane showing it closes)."""
        for sig, slot in (
            (self.session.pathChanged, self._sync_rows),
            (self.session.messageChanged, self._on_grew),
            (self.session.messageFinished, self._on_finished),
            (theme_manager().changed, self._on_theme),
        ):
            disconnect(sig, slot)
        self.throttle.discard(self)


def tool_html(msg: Message, expanded: bool, theme: MarkdownTheme) -> str:
    """A tool call as a block: the tool and its arguments, then what became of it. Closed,
    a finished call shows the start of its result; open (a click on ▸), all of it."""
    call = msg.meta.get("tool_call") or {}
    state = msg.meta.get("state", "")
    server = f' <span style="color:{theme.quote_fg};">· {escape(msg.meta.get("server", ""))}'\
        '</span>' if msg.meta.get("server") else ""
    arrow = "▾" if expanded else "▸"
    head = (f'<p><a href="{TOGGLE_SCHEME}">{arrow} <b>{escape(call.get("name", ""))}</b></a>'
            f' <code>{escape(_short(call.get("arguments", ""), 200))}</code>{server}</p>')
    if state == "asking":
        return head + "<p><i>Waiting for your answer…</i></p>"
    if state == "running":
        return head + "<p><i>Running…</i></p>"
    error = state == "error" or msg.meta.get("is_error")
    color = ' style="color:#d64545;"' if error else ""
    if not expanded:
        return head + f"<p{color}>{escape(_short(msg.content, SUMMARY_CHARS))}</p>"
    arguments = call.get("arguments", "")
    return (head + f'<pre style="background:{theme.inline_code_bg};">{escape(arguments)}</pre>'
            f"<pre{color}>{escape(msg.content)}</pre>")


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def status_text(msg: Message) -> str:
    """A short label for a message's status (empty for a normal finished message)."""
    return {
        Status.PENDING: "Thinking…",
        Status.STREAMING: "",
        Status.STOPPED: "Stopped",
        Status.INTERRUPTED: "Interrupted",
        Status.LENGTH: "Cut at max tokens",
        Status.ERROR: "Error",
    }.get(msg.status, "")


def sentence(text: str) -> str:
    """An engine message shown to the user: capitalised, ending with a full stop."""
    text = text.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text[-1] in ".!?…" else text + "."
