"""The conversation sidebar: search (titles and message text), new, rename, delete, open.

Model/view: ConversationListModel lists the store's conversations (most recent first);
ConversationFilter narrows them to the folder chosen (app/library/folder_bar.py) and to the ids the
store's full-text search returns; while a search is typed its ranked hits
(app/library/search_results.py) stand in for the list, and Enter opens the first one. Rename is in
place (F2 or double-click on the title... or the context menu); delete asks first.
"""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import (
    QAbstractListModel,
    QEvent,
    QModelIndex,
    QPersistentModelIndex,
    QRect,
    QSize,
    QSortFilterProxyModel,
    Qt,
    QTimer,
    Signal,
)
from PySide6.QtGui import (
    QColor,
    QContextMenuEvent,
    QFont,
    QFontMetrics,
    QKeyEvent,
    QPainter,
    QPalette,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListView,
    QMenu,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.core.records import Conversation
from app.core.session_logic import DEFAULT_TITLE
from app.library.folder_bar import ALL, CHAT_IDS_MIME, FolderPanel, encode_chat_ids
from app.library.search_results import SearchResultsView
from app.ui import colors, icons
from app.ui.elided_label import ElidedLabel

ConvIdRole = Qt.ItemDataRole.UserRole + 1
UpdatedRole = Qt.ItemDataRole.UserRole + 2
BusyRole = Qt.ItemDataRole.UserRole + 3
StartedRole = Qt.ItemDataRole.UserRole + 4  # written in or named (else not listed yet)
ModelRole = Qt.ItemDataRole.UserRole + 5  # the chat's remote model ("" for the local one)
FolderRole = Qt.ItemDataRole.UserRole + 6  # the chat's folder id (None: the top level)
#: Where the chat's context is ("memory", "disk", "recompute"; "" not known): the engine's
#: ``ContextResidency.state``, kept by app/window/context_watch.py (docs/ARCHITECTURE.md §3.14)
ContextRole = Qt.ItemDataRole.UserRole + 7
#: The chat is kept warm (its blocks stay in memory while others can go): a bool
PinnedRole = Qt.ItemDataRole.UserRole + 8
#: What each context state reads as under a chat's title.
CONTEXT_TEXT = {"memory": "in memory", "disk": "asleep on disk",
                "recompute": "needs reading again"}


def relative_time(ts: float, now: float | None = None) -> str:
    now = now or time.time()
    lt, ln = time.localtime(ts), time.localtime(now)
    if lt.tm_year == ln.tm_year and lt.tm_yday == ln.tm_yday:
        return time.strftime("%H:%M", lt)
    if now - ts < 7 * 86400:
        return time.strftime("%a %H:%M", lt)
    return time.strftime("%d %b %Y", lt)


class ConversationListModel(QAbstractListModel):
    renameRequested = Signal(str, str)  # conversation id, new title

    def __init__(self, store: Any, parent: Any = None) -> None:
        super().__init__(parent)
        self.store = store
        self._items: list[Conversation] = []
        self._busy: set[str] = set()
        self._context: dict[str, str] = {}  # conversation id -> ContextRole's state
        self.pinned: set[str] = set()  # conversation ids kept warm (PinnedRole)
        # a chat's model reference -> its label ("model @ provider"); set by the window
        self.model_label: Any = None
        self.reload()

    def reload(self) -> None:
        self.beginResetModel()
        self._items = self.store.list_conversations()
        for c in self._items:  # the stored colour, also for chats not opened this run
            colors.register(c.id, c.color_index)
        self.endResetModel()

    def set_busy(self, conversation_id: str, busy: bool) -> None:
        (self._busy.add if busy else self._busy.discard)(conversation_id)
        for i, c in enumerate(self._items):
            if c.id == conversation_id:
                self.dataChanged.emit(self.index(i), self.index(i))

    def set_context(self, conversation_id: str, state: str) -> None:
        """Where a chat's context is now (ContextRole); repaints its row when it changed."""
        if self._context.get(conversation_id, "") == state:
            return
        self._context[conversation_id] = state
        row = self.row_of(conversation_id)
        if row >= 0:
            self.dataChanged.emit(self.index(row), self.index(row))

    def set_pinned(self, conversation_id: str, pinned: bool) -> None:
        (self.pinned.add if pinned else self.pinned.discard)(conversation_id)
        row = self.row_of(conversation_id)
        if row >= 0:
            self.dataChanged.emit(self.index(row), self.index(row))

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._items)

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = 0) -> Any:
        if not index.isValid():
            return None
        c = self._items[index.row()]
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole):
            return c.title
        if role == ModelRole:
            return self.model_label(c.model) if (c.model and self.model_label) else ""
        if role == Qt.ItemDataRole.ToolTipRole:
            model = self.data(index, ModelRole)
            return f"{c.title}\n{model}" if model else c.title
        if role == Qt.ItemDataRole.AccessibleTextRole:
            busy = ", answering" if c.id in self._busy else ""
            model = self.data(index, ModelRole)
            model = f", {model}" if model else ""
            context = CONTEXT_TEXT.get(self._context.get(c.id, ""), "")
            context = f", context {context}" if context else ""
            context += ", kept warm" if c.id in self.pinned else ""
            return f"{c.title}, {relative_time(c.updated)}{model}{busy}{context}"
        if role == ConvIdRole:
            return c.id
        if role == UpdatedRole:
            return c.updated
        if role == BusyRole:
            return c.id in self._busy
        if role == StartedRole:  # written in, or named by the user
            return c.active_leaf is not None or c.title != DEFAULT_TITLE
        if role == FolderRole:
            return c.folder_id
        if role == ContextRole:
            return self._context.get(c.id, "")
        if role == PinnedRole:
            return c.id in self.pinned
        return None

    def setData(
        self, index: QModelIndex | QPersistentModelIndex, value: Any, role: int = 0
    ) -> bool:
        if role != Qt.ItemDataRole.EditRole or not index.isValid():
            return False
        title = str(value).strip()
        if not title:
            return False
        c = self._items[index.row()]
        c.title = title
        self.renameRequested.emit(c.id, title)
        self.dataChanged.emit(index, index)
        return True

    def flags(self, index: QModelIndex | QPersistentModelIndex) -> Qt.ItemFlag:
        base = super().flags(index)
        if not index.isValid():
            return base
        return base | Qt.ItemFlag.ItemIsEditable | Qt.ItemFlag.ItemIsDragEnabled

    def mimeTypes(self) -> list[str]:
        return [CHAT_IDS_MIME]

    def mimeData(self, indexes: Any) -> Any:
        """The dragged chats' ids, for a drop on a folder (app/library/folder_bar.py)."""
        ids = [self._items[i.row()].id for i in indexes if i.isValid()]
        return encode_chat_ids(list(dict.fromkeys(ids)))

    def row_of(self, conversation_id: str) -> int:
        for i, c in enumerate(self._items):
            if c.id == conversation_id:
                return i
        return -1


class ConversationFilter(QSortFilterProxyModel):
    """Shows conversations that have begun (an empty "New Chat" is listed from its first
    message on, so empty ones never pile up as look-alikes) and match the query (title or
    message text)."""

    def __init__(self, store: Any, parent: Any = None) -> None:
        super().__init__(parent)
        self.store = store
        self.query = ""
        self._ids: set[str] | None = None
        self.folder = ALL  # the folder shown (ALL: every chat)

    def _set_ids(self, ids: set[str] | None) -> None:
        if hasattr(self, "beginFilterChange"):  # Qt >= 6.9
            self.beginFilterChange()
            self._ids = ids
            self.endFilterChange()
        else:
            self._ids = ids
            self.invalidateFilter()

    def set_query(self, text: str) -> None:
        self.query = text.strip()
        self._set_ids(self.store.search(self.query) if self.query else None)

    def refresh(self) -> None:
        if self.query:
            self._set_ids(self.store.search(self.query))

    def set_folder(self, folder_id: str) -> None:
        self.folder = folder_id
        self._set_ids(self._ids)

    def filterAcceptsRow(self, row: int, parent: QModelIndex | QPersistentModelIndex) -> bool:
        idx = self.sourceModel().index(row, 0, parent)
        if not idx.data(StartedRole):
            return False
        if self.folder != ALL and idx.data(FolderRole) != self.folder:
            return False
        return self._ids is None or idx.data(ConvIdRole) in self._ids


class ConversationDelegate(QStyledItemDelegate):
    ROW_H = 44

    def sizeHint(self, option: QStyleOptionViewItem, index: Any) -> QSize:
        return QSize(option.rect.width(), self.ROW_H)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: Any) -> None:
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = option.palette
        r = option.rect.adjusted(6, 2, -6, -2)
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        hover = bool(option.state & QStyle.StateFlag.State_MouseOver)
        text = pal.color(QPalette.ColorRole.Text)
        if selected or hover:
            bg = QColor(text)
            bg.setAlphaF(0.10 if selected else 0.05)
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(bg)
            painter.drawRoundedRect(r, 8, 8)
        if option.state & QStyle.StateFlag.State_HasFocus and selected:
            focus = QColor(pal.color(QPalette.ColorRole.Highlight))
            focus.setAlphaF(0.6)
            painter.setPen(focus)
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawRoundedRect(r, 8, 8)
        cid = index.data(ConvIdRole)
        accent = colors.accent_color(cid)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(accent)
        painter.drawEllipse(QRect(r.left() + 10, r.top() + 10, 8, 8))
        font = QFont(option.font)
        title_font = QFont(font)
        title_font.setWeight(QFont.Weight.Medium)
        small = QFont(font)
        small.setPointSizeF(max(7.0, font.pointSizeF() * 0.85))
        x = r.left() + 26
        w = r.right() - x - 6
        fm = QFontMetrics(title_font)
        painter.setFont(title_font)
        painter.setPen(text)
        title = fm.elidedText(
            index.data(Qt.ItemDataRole.DisplayRole) or "", Qt.TextElideMode.ElideRight, w
        )
        painter.drawText(QRect(x, r.top() + 4, w, fm.height()), Qt.AlignmentFlag.AlignLeft, title)
        painter.setFont(small)
        muted = pal.color(QPalette.ColorRole.PlaceholderText)
        painter.setPen(muted)
        sub = relative_time(index.data(UpdatedRole) or 0)
        if index.data(ModelRole):
            sub += f"  ·  {index.data(ModelRole)}"
        context = CONTEXT_TEXT.get(index.data(ContextRole) or "")
        if context:
            sub += f"  ·  {context}" + (" (kept warm)" if index.data(PinnedRole) else "")
        if index.data(BusyRole):
            sub = "Answering…  " + sub
            painter.setPen(accent)
        painter.drawText(
            QRect(x, r.top() + 6 + fm.height(), w, QFontMetrics(small).height()),
            Qt.AlignmentFlag.AlignLeft,
            sub,
        )
        painter.restore()


class ConversationListView(QListView):
    openRequested = Signal(str, bool)  # conversation id, in a new pane
    deleteRequested = Signal(str)
    sleepRequested = Signal(str)  # put the chat's context to sleep (out of memory, on disk)
    keepWarmRequested = Signal(str, bool)  # keep the chat's context in memory, or no more

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("conversationList")
        self.setAccessibleName("Conversations")
        self.setItemDelegate(ConversationDelegate(self))
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setMouseTracking(True)
        self.setEditTriggers(
            QAbstractItemView.EditTrigger.EditKeyPressed
            | QAbstractItemView.EditTrigger.SelectedClicked
        )
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.activated.connect(self._activated)
        self.clicked.connect(self._activated)

    def _cid(self, index: Any) -> str | None:
        return index.data(ConvIdRole) if index is not None and index.isValid() else None

    def _activated(self, index: Any) -> None:
        cid = self._cid(index)
        if cid:
            from PySide6.QtWidgets import QApplication

            new_pane = bool(
                QApplication.keyboardModifiers()
                & (Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.MetaModifier)
            )
            self.openRequested.emit(cid, new_pane)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        cid = self._cid(self.currentIndex())
        if (
            cid
            and event.key() in (Qt.Key.Key_Delete, Qt.Key.Key_Backspace)
            and self.state() != (QAbstractItemView.State.EditingState)
        ):
            self.deleteRequested.emit(cid)
            return
        super().keyPressEvent(event)

    def contextMenuEvent(self, event: QContextMenuEvent) -> None:
        index = (
            self.indexAt(event.pos())
            if event.reason() == event.Reason.Mouse
            else (self.currentIndex())
        )
        cid = self._cid(index)
        if not cid:
            return
        menu = QMenu(self)
        menu.setAccessibleName("Conversation actions")
        menu.addAction("Open", lambda: self.openRequested.emit(cid, False))
        menu.addAction("Open in New Pane", lambda: self.openRequested.emit(cid, True))
        menu.addSeparator()
        menu.addAction("Rename…", lambda: self.edit(index))
        if index.data(ContextRole):  # an open chat the engine answers for
            warm = bool(index.data(PinnedRole))
            keep = menu.addAction("Keep in Memory",
                                  lambda: self.keepWarmRequested.emit(cid, not warm))
            keep.setCheckable(True)
            keep.setChecked(warm)
        if index.data(ContextRole) == "memory":
            menu.addAction("Put to Sleep", lambda: self.sleepRequested.emit(cid))
        menu.addAction("Delete…", lambda: self.deleteRequested.emit(cid))
        menu.exec(event.globalPos())


class Sidebar(QFrame):
    newChatRequested = Signal()

    def __init__(self, store: Any, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("sidebar")
        self.setAccessibleName("Sidebar")
        self.store = store
        self.current_id: str | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 10, 8, 8)
        layout.setSpacing(8)

        top = QHBoxLayout()
        heading = ElidedLabel("Chats")  # its big font must not set the sidebar's minimum
        heading.setObjectName("sidebarHeading")
        top.addWidget(heading, 1)
        self.new_button = QToolButton()
        self.new_button.setIcon(icons.icon("new-chat", size=16))
        self.new_button.setAccessibleName("New chat")
        self.new_button.setToolTip("New chat")
        self.new_button.setAutoRaise(True)
        self.new_button.clicked.connect(self.newChatRequested)
        top.addWidget(self.new_button)
        layout.addLayout(top)

        self.search = QLineEdit()
        self.search.setObjectName("searchField")
        self.search.setPlaceholderText("Search chats")
        self.search.setAccessibleName("Search chats")
        self.search.setClearButtonEnabled(True)
        glyph = self.search.addAction(
            icons.icon("search", size=14), QLineEdit.ActionPosition.LeadingPosition
        )
        glyph.setText("Search")  # its button's name and tooltip for screen readers
        glyph.setToolTip("Search chat titles, messages and attached files (Ctrl+F)")
        glyph.triggered.connect(lambda: self.search.setFocus())
        self.search.installEventFilter(self)
        layout.addWidget(self.search)

        self.folders = FolderPanel(store, self)
        layout.addWidget(self.folders)

        self.model = ConversationListModel(store, self)
        self.proxy = ConversationFilter(store, self)
        self.proxy.setSourceModel(self.model)
        self.view = ConversationListView()
        self.view.setModel(self.proxy)
        self.view.setDragEnabled(True)  # onto a folder (app/library/folder_bar.py)
        self.view.setDragDropMode(QAbstractItemView.DragDropMode.DragOnly)
        self.folders.changed.connect(self.reload)
        self.folders.view.folderChosen.connect(self._folder_chosen)
        layout.addWidget(self.view, 1)

        # while a search is typed: its ranked hits with snippets, in place of the list
        self.results = SearchResultsView()
        self.results.hide()
        self.results.escapePressed.connect(self._clear_search_from_results)
        layout.addWidget(self.results, 1)

        self.empty = QLabel("No chats match.")
        self.empty.setObjectName("sidebarEmpty")
        self.empty.setAlignment(Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop)
        self.empty.setWordWrap(True)
        self.empty.setAccessibleName("Search results")
        self.empty.hide()
        layout.addWidget(self.empty, 1)

        self._search_timer = QTimer(self)
        self._search_timer.setSingleShot(True)
        self._search_timer.setInterval(150)
        self._search_timer.timeout.connect(self._apply_search)
        self.search.textChanged.connect(lambda _t: self._search_timer.start())

    def _apply_search(self) -> None:
        query = self.search.text().strip()
        self.proxy.set_query(query)
        listed = set(self.visible_ids())  # hits in chats the list shows (not empty ones)
        hits = [h for h in self.store.search_hits(query) if h.conversation_id in listed]
        self.results.set_hits(hits if query else [])
        none = bool(query) and not hits
        if none:
            shown = query if len(query) <= 40 else query[:39] + "…"
            self.empty.setText(f"No chats match “{shown}”.\nEsc clears the search.")
        self.empty.setVisible(none)
        self.view.setVisible(not query)
        self.results.setVisible(bool(hits))
        if self.current_id:
            self.select(self.current_id)

    def eventFilter(self, obj: Any, event: Any) -> bool:
        if obj is self.search and event.type() == QEvent.Type.KeyPress and self.search.text():
            key = event.key()
            if key == Qt.Key.Key_Escape:
                self.set_search("")
                return True
            if key in (Qt.Key.Key_Return, Qt.Key.Key_Enter, Qt.Key.Key_Down):
                if self._search_timer.isActive():  # typed faster than the search delay
                    self._search_timer.stop()
                    self._apply_search()
                if key == Qt.Key.Key_Down:
                    self.results.setFocus()
                else:
                    self.results.activate_current()  # the first hit unless moved to another
                return True
        return super().eventFilter(obj, event)

    def _clear_search_from_results(self) -> None:
        self.set_search("")
        self.search.setFocus()

    def set_search(self, text: str) -> None:
        """Search at once (no typing delay): used by tests and the Find action."""
        self.search.setText(text)
        self._search_timer.stop()
        self._apply_search()

    def _folder_chosen(self, folder_id: str) -> None:
        self.proxy.set_folder(folder_id)
        if self.search.text().strip():
            self._apply_search()

    def visible_ids(self) -> list[str]:
        return [self.proxy.index(r, 0).data(ConvIdRole) for r in range(self.proxy.rowCount())]

    def reload(self) -> None:
        self.model.reload()
        self.proxy.refresh()
        self.folders.reload()  # names and chat counts
        if self.current_id:
            self.select(self.current_id)

    def select(self, conversation_id: str | None) -> None:
        """Highlight the chat shown in the focused pane (nothing when it is not listed: an
        empty chat, or one the search hides)."""
        self.current_id = conversation_id
        row = self.model.row_of(conversation_id) if conversation_id else -1
        idx = self.proxy.mapFromSource(self.model.index(row)) if row >= 0 else QModelIndex()
        if idx.isValid():
            self.view.setCurrentIndex(idx)
        else:
            self.view.selectionModel().clear()

    def highlighted_id(self) -> str | None:
        """The chat the list highlights (selected), if any."""
        rows = self.view.selectionModel().selectedRows()
        return rows[0].data(ConvIdRole) if rows else None

    def focus_search(self) -> None:
        """Put the cursor in the search field, its text selected (the Find command)."""
        self.search.setFocus()
        self.search.selectAll()

    def start_rename(self, conversation_id: str) -> None:
        """Select a chat and open its title for editing (the Rename command)."""
        self.select(conversation_id)
        self.view.edit(self.view.currentIndex())

    def refresh_icons(self) -> None:
        self.new_button.setIcon(icons.icon("new-chat", size=16))
