"""The legend: one row per chat known to the engine, with its colour and per-chat pool numbers.

A Qt model/view pair: `LegendModel` (QAbstractTableModel) turns `snapshot.sessions` into rows
and updates them in place (insert / remove / dataChanged, never a reset), so the selection and
the hover survive the 10 Hz refresh; `LegendView` (QTableView) reports which chat was clicked
or hovered so the panel can highlight its blocks and focus its pane.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import (
    QAbstractTableModel,
    QModelIndex,
    QPersistentModelIndex,
    QRect,
    QSize,
    Qt,
    Signal,
)
from PySide6.QtGui import QColor, QIcon, QPainter, QPixmap
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableView, QWidget

from app import colors

Index = QModelIndex | QPersistentModelIndex
MIN_ROWS, MAX_ROWS = 3, 6

STATE_LABELS = {
    "waiting": "waiting",
    "prefilling": "prefilling",
    "decoding": "decoding",
    "preempted": "preempted",
    "finished": "idle",
}
STATE_TIPS = {
    "waiting": "Queued: waiting for free blocks or a batch slot",
    "prefilling": "Computing the prompt's KV (in chunks, so other chats keep streaming)",
    "decoding": "Generating, one token per step in the shared batch",
    "preempted": "Evicted to make room: its blocks were freed; it will be recomputed",
    "finished": "Nothing running: the chat holds no blocks",
}


@dataclass(frozen=True)
class Column:
    title: str
    tip: str
    numeric: bool = True


COLUMNS = (
    Column("Chat", "The chat (its colour is its pane's accent and its blocks' colour)", False),
    Column("State", "waiting · prefilling · decoding · preempted · idle", False),
    Column("Held", "KV blocks the chat's sequences hold"),
    Column("Shared", "Of those, blocks also held by another sequence (refcount > 1)"),
    Column("Tokens", "Tokens in the chat's KV cache"),
    Column("Waste", "Allocated slots not holding a token (the unfilled tail of its last blocks)"),
    Column("tok/s", "Tokens generated per second by this chat (last 2 s)"),
)
CHAT, STATE, BLOCKS, SHARED, TOKENS, WASTE, RATE = range(len(COLUMNS))


@dataclass(frozen=True)
class Row:
    session_id: str
    name: str
    state: str
    blocks: int
    shared: int
    tokens: int
    waste: int
    rate: float


def _alignment(col: Column) -> int:
    side = Qt.AlignmentFlag.AlignRight if col.numeric else Qt.AlignmentFlag.AlignLeft
    return int(side | Qt.AlignmentFlag.AlignVCenter)


def _swatch(color: QColor, size: int = 12) -> QIcon:
    pixmap = QPixmap(size * 2, size * 2)
    pixmap.setDevicePixelRatio(2.0)
    pixmap.fill(Qt.GlobalColor.transparent)
    p = QPainter(pixmap)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(color)
    p.drawRoundedRect(QRect(1, 1, size - 2, size - 2), 3, 3)
    p.end()
    return QIcon(pixmap)


class LegendModel(QAbstractTableModel):
    """Rows of per-chat stats, in order of first appearance."""

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._rows: list[Row] = []
        self._icons: dict[str, QIcon] = {}
        self.warning = QColor("#E5484D")
        self.muted = QColor("#8E8E93")

    # ---- updates ---------------------------------------------------------------------------

    def update_from(self, snap: Any, name: Callable[[str], str]) -> None:
        """Bring the rows in line with `snap.sessions` with minimal model signals."""
        sessions = dict(snap.sessions) if snap is not None else {}
        for i in range(len(self._rows) - 1, -1, -1):
            if self._rows[i].session_id not in sessions:
                self.beginRemoveRows(QModelIndex(), i, i)
                del self._rows[i]
                self.endRemoveRows()
        known = {r.session_id: i for i, r in enumerate(self._rows)}
        new_rows = []
        for sid, stats in sessions.items():
            row = Row(
                session_id=sid,
                name=name(sid),
                state=str(getattr(stats.state, "value", stats.state)),
                blocks=int(stats.blocks_held),
                shared=int(stats.blocks_shared),
                tokens=int(stats.tokens_in_context),
                waste=int(stats.wasted_slots),
                rate=float(stats.tokens_per_s),
            )
            i = known.get(sid)
            if i is None:
                new_rows.append(row)
            elif self._rows[i] != row:
                self._rows[i] = row
                self.dataChanged.emit(self.index(i, 0), self.index(i, len(COLUMNS) - 1))
        if new_rows:
            first = len(self._rows)
            self.beginInsertRows(QModelIndex(), first, first + len(new_rows) - 1)
            self._rows.extend(new_rows)
            self.endInsertRows()

    def refresh_colors(self) -> None:
        """Chat colours can change (a conversation registered later): redraw the swatches."""
        self._icons.clear()
        if self._rows:
            self.dataChanged.emit(self.index(0, CHAT), self.index(len(self._rows) - 1, CHAT))

    # ---- queries ---------------------------------------------------------------------------

    def session_at(self, row: int) -> str | None:
        return self._rows[row].session_id if 0 <= row < len(self._rows) else None

    def row_of(self, session_id: str | None) -> int:
        for i, r in enumerate(self._rows):
            if r.session_id == session_id:
                return i
        return -1

    def row_data(self, session_id: str) -> Row | None:
        i = self.row_of(session_id)
        return self._rows[i] if i >= 0 else None

    # ---- QAbstractTableModel ---------------------------------------------------------------

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = 0) -> Any:
        if orientation != Qt.Orientation.Horizontal or not 0 <= section < len(COLUMNS):
            return None
        col = COLUMNS[section]
        if role == Qt.ItemDataRole.DisplayRole:
            return col.title
        if role == Qt.ItemDataRole.ToolTipRole:
            return col.tip
        if role == Qt.ItemDataRole.TextAlignmentRole:
            return _alignment(col)
        return None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        row, col = self._rows[index.row()], index.column()
        idle = row.state == "finished"
        if role == Qt.ItemDataRole.DisplayRole:
            return self._display(row, col)
        if role == Qt.ItemDataRole.DecorationRole and col == CHAT:
            icon = self._icons.get(row.session_id)
            if icon is None:
                icon = self._icons[row.session_id] = _swatch(colors.accent_color(row.session_id))
            return icon
        if role == Qt.ItemDataRole.ToolTipRole:
            if col == STATE:
                return STATE_TIPS.get(row.state, row.state)
            if col == CHAT:
                return f"{row.name}\nsession {row.session_id}"
            return COLUMNS[col].tip
        if role == Qt.ItemDataRole.TextAlignmentRole:
            return _alignment(COLUMNS[col])
        if role == Qt.ItemDataRole.ForegroundRole:
            if col == STATE and row.state == "preempted":
                return self.warning
            if idle and col != CHAT:
                return self.muted
        if role == Qt.ItemDataRole.AccessibleTextRole:
            return f"{COLUMNS[col].title}: {self._display(row, col)}"
        if role == Qt.ItemDataRole.UserRole:
            return row.session_id
        return None

    @staticmethod
    def _display(row: Row, col: int) -> str:
        if col == CHAT:
            return row.name
        if col == STATE:
            return STATE_LABELS.get(row.state, row.state)
        if col == BLOCKS:
            return f"{row.blocks:,}"
        if col == SHARED:
            return f"{row.shared:,}" if row.shared else "–"
        if col == TOKENS:
            return f"{row.tokens:,}"
        if col == WASTE:
            return f"{row.waste:,}"
        if col == RATE:
            return f"{row.rate:.1f}" if row.rate >= 0.05 else "–"
        return ""


class LegendView(QTableView):
    """The legend table; a click selects (and toggles) a chat, hovering reports it."""

    sessionClicked = Signal(object)  # session id, or None when the selection was cleared
    sessionHovered = Signal(object)  # session id, or None

    def __init__(self, model: LegendModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("monitorLegend")
        self.setAccessibleName("Chats in the KV pool")
        self.setAccessibleDescription(
            "One row per chat: colour, state, blocks held and shared, tokens, wasted slots, "
            "tokens per second. Select a row to highlight its blocks and focus its pane."
        )
        self.setModel(model)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setShowGrid(False)
        self.setWordWrap(False)
        self.setMouseTracking(True)
        self.setAlternatingRowColors(False)
        self.setIconSize(QSize(12, 12))
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self.verticalHeader().hide()
        header = self.horizontalHeader()
        header.setHighlightSections(False)
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(CHAT, QHeaderView.ResizeMode.Stretch)
        header.setMinimumSectionSize(30)
        self.setFrameShape(QTableView.Shape.NoFrame)
        font = self.font()
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.9))
        self.setFont(font)
        header.setFont(font)
        self.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 7)
        self._hovered: str | None = None
        self._selected: str | None = None
        self.clicked.connect(self._clicked)
        self.entered.connect(self._entered)
        model.rowsInserted.connect(self.fit_rows)
        model.rowsRemoved.connect(self.fit_rows)
        self.fit_rows()

    def legend_model(self) -> LegendModel:
        model = self.model()
        assert isinstance(model, LegendModel)
        return model

    def select_session(self, session_id: str | None) -> None:
        """Select a chat's row without emitting sessionClicked (None clears)."""
        row = self.legend_model().row_of(session_id) if session_id else -1
        if row < 0:
            self.clearSelection()
            self._selected = None
            return
        self.selectRow(row)
        self._selected = session_id

    def selected_session(self) -> str | None:
        rows = self.selectionModel().selectedRows() if self.selectionModel() else []
        return self.legend_model().session_at(rows[0].row()) if rows else None

    def _clicked(self, index: QModelIndex) -> None:
        sid = self.legend_model().session_at(index.row())
        if sid is not None and sid == self._selected:
            self.clearSelection()  # a second click on the selected chat clears the highlight
            self._selected = None
            self.sessionClicked.emit(None)
            return
        self._selected = sid
        self.sessionClicked.emit(sid)

    def _entered(self, index: QModelIndex) -> None:
        sid = self.legend_model().session_at(index.row())
        if sid != self._hovered:
            self._hovered = sid
            self.sessionHovered.emit(sid)

    def leaveEvent(self, event: Any) -> None:
        if self._hovered is not None:
            self._hovered = None
            self.sessionHovered.emit(None)
        super().leaveEvent(event)

    def fit_rows(self) -> None:
        """Be as tall as the rows (between MIN_ROWS and MAX_ROWS; more rows scroll)."""
        rows = max(MIN_ROWS, min(MAX_ROWS, self.legend_model().rowCount()))
        height = self.horizontalHeader().sizeHint().height() + rows * (
            self.verticalHeader().defaultSectionSize()
        )
        if self.height() != height + 2:
            self.setFixedHeight(height + 2)
