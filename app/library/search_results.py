"""The sidebar's search results: one row per hit (the chat's title, who wrote it, a snippet
with the words found highlighted), best first, from the store's FTS5 search
(app/core/search.py, docs/ARCHITECTURE.md §6.5).

Enter or a click on a row asks for that message in its pane (`hitActivated`); the sidebar
shows this list instead of the chat list while a search is typed, and its "no results" state
when there is nothing.
"""

from __future__ import annotations

import html
from typing import Any

from PySide6.QtCore import (
    QAbstractListModel,
    QModelIndex,
    QPersistentModelIndex,
    QRectF,
    QSize,
    Qt,
    Signal,
)
from PySide6.QtGui import QKeyEvent, QPainter, QPalette, QTextDocument
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFrame,
    QListView,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QWidget,
)

from app.core.search import MARK_END, MARK_START, Hit

HitRole = Qt.ItemDataRole.UserRole + 1
ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System", "": "Title",
              "attachment": "Attached file"}


def plain(snippet: str) -> str:
    return snippet.replace(MARK_START, "").replace(MARK_END, "")


def snippet_html(snippet: str, highlight: str) -> str:
    """The snippet as rich text: escaped, line breaks folded, the marked words bold on the
    highlight colour."""
    text = html.escape(" ".join(snippet.split()))
    return text.replace(MARK_START, f'<b style="background-color:{highlight};">').replace(
        MARK_END, "</b>"
    )


class SearchHitModel(QAbstractListModel):
    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.hits: list[Hit] = []

    def set_hits(self, hits: list[Hit]) -> None:
        self.beginResetModel()
        self.hits = list(hits)
        self.endResetModel()

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.hits)

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = 0) -> Any:
        if not index.isValid():
            return None
        hit = self.hits[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return hit.title if hit.message_id is None else plain(hit.snippet)
        if role in (Qt.ItemDataRole.AccessibleTextRole, Qt.ItemDataRole.ToolTipRole):
            who = ROLE_NAMES.get(hit.role, hit.role)
            return f"{hit.title}, {who}: {plain(hit.snippet)}"
        if role == HitRole:
            return hit
        return None


class SearchHitDelegate(QStyledItemDelegate):
    """Title and role on one line, the highlighted snippet (two lines at most) below."""

    PAD = 8

    def _doc(self, option: QStyleOptionViewItem, hit: Hit) -> QTextDocument:
        pal = option.palette
        muted = pal.color(QPalette.ColorRole.PlaceholderText).name()
        mark = pal.color(QPalette.ColorRole.Highlight)
        mark.setAlphaF(0.35)
        who = ROLE_NAMES.get(hit.role, hit.role)
        body = snippet_html(hit.snippet, mark.name(mark.NameFormat.HexArgb))
        doc = QTextDocument()
        doc.setDefaultFont(option.font)
        doc.setDocumentMargin(0)
        doc.setTextWidth(max(40, option.rect.width() - 2 * self.PAD))
        title = html.escape(hit.title) if hit.message_id else body
        line2 = (
            f'<br/><span style="color:{muted};">{html.escape(who)} · </span>{body}'
            if hit.message_id
            else ""
        )
        doc.setHtml(f"<b>{title}</b>{line2}")
        return doc

    def sizeHint(self, option: QStyleOptionViewItem, index: Any) -> QSize:
        doc = self._doc(option, index.data(HitRole))
        lines = option.fontMetrics.lineSpacing()
        return QSize(option.rect.width(), int(min(doc.size().height(), 3 * lines)) + self.PAD)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: Any) -> None:
        painter.save()
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        if selected or option.state & QStyle.StateFlag.State_MouseOver:
            bg = option.palette.color(QPalette.ColorRole.Text)
            bg.setAlphaF(0.10 if selected else 0.05)
            painter.fillRect(option.rect.adjusted(2, 1, -2, -1), bg)
        r = option.rect.adjusted(self.PAD, self.PAD // 2, -self.PAD, -self.PAD // 2)
        painter.translate(r.topLeft())
        painter.setClipRect(QRectF(0, 0, r.width(), r.height()))
        self._doc(option, index.data(HitRole)).drawContents(painter)
        painter.restore()


class SearchResultsView(QListView):
    hitActivated = Signal(str, object)  # conversation id, message id (None: a title hit)
    escapePressed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("searchResults")
        self.setAccessibleName("Search results")
        self.hit_model = SearchHitModel(self)
        self.setModel(self.hit_model)
        self.setItemDelegate(SearchHitDelegate(self))
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setMouseTracking(True)
        self.setWordWrap(True)
        self.setUniformItemSizes(False)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.activated.connect(self._activate)
        self.clicked.connect(self._activate)

    def set_hits(self, hits: list[Hit]) -> None:
        self.hit_model.set_hits(hits)
        if hits:
            self.setCurrentIndex(self.hit_model.index(0))

    def activate_current(self) -> bool:
        """Open the current hit (the first unless the user moved): Enter in the search box."""
        index = self.currentIndex()
        if not index.isValid():
            return False
        self._activate(index)
        return True

    def _activate(self, index: Any) -> None:
        hit: Hit | None = index.data(HitRole) if index.isValid() else None
        if hit is not None:
            self.hitActivated.emit(hit.conversation_id, hit.message_id)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() == Qt.Key.Key_Escape:
            self.escapePressed.emit()
            return
        super().keyPressEvent(event)
