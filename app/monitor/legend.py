"""The legend: one row per chat known to the engine, with its colour and per-chat pool numbers.

A Qt model/view pair: `LegendModel` (QAbstractTableModel) turns `snapshot.sessions` into rows
and updates them in place (insert / remove / dataChanged, never a reset), so the selection and
the hover survive the 10 Hz refresh; `LegendView` (QTableView) reports which chat was clicked
or hovered so the panel can highlight its blocks and focus its pane.
"""

from __future__ import annotations

import dataclasses
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
from PySide6.QtGui import QColor, QFont, QFontMetrics, QIcon, QPainter, QPalette, QPixmap
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QTableView,
    QWidget,
)

from app.core.rates import fmt_rate, shown_rate
from app.ui import colors
from engine import SequenceState, SessionStats

Index = QModelIndex | QPersistentModelIndex
MIN_ROWS, MAX_ROWS = 3, 6

STATE_LABELS = {
    "waiting": "waiting",
    "prefilling": "prefilling",
    "decoding": "decoding",
    "preempted": "preempted",
    "finished": "idle",
    "remote": "remote",
}
STATE_TIPS = {
    "waiting": "Queued: waiting for free blocks or a batch slot",
    "prefilling": "Computing the prompt's KV (in chunks, so other chats keep streaming)",
    "decoding": "Generating, one token per step in the shared batch",
    "preempted": "Evicted to make room: its blocks were freed; it will be recomputed",
    "finished": "Nothing running: the chat holds no blocks",
    "remote": "Talks to a remote provider: it holds no blocks of this pool",
}


def _live(row: Row) -> bool:
    """The chat has a request in the engine (its priority means something now)."""
    return row.state in ("waiting", "prefilling", "decoding", "preempted")


def _queued_stats(session_id: str) -> SessionStats:
    """A row for a chat whose first request the engine has not taken in yet."""
    return SessionStats(session_id, SequenceState.WAITING, 0, 0, 0, 0, 0.0, 1)


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


#: How the table names the engine's priorities (engine.Priority's values; NORMAL unnamed).
PRIORITY_LABELS = {2: "interactive", 0: "background"}
PRIORITY_TIPS = {
    2: "Interactive: the chat in front of you (focused, or just sent) goes first",
    1: "Normal priority",
    0: "Background: it yields to the chat in front of you (another pane, an API request "
       "or a long paste)",
}


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
    priority: int = 1  # engine.Priority's value
    reason: str = ""  # why it waits, in the engine's words ("" when it runs)


_DISPLAY = int(Qt.ItemDataRole.DisplayRole)
_DECORATION = int(Qt.ItemDataRole.DecorationRole)
_TOOLTIP = int(Qt.ItemDataRole.ToolTipRole)
_ALIGN = int(Qt.ItemDataRole.TextAlignmentRole)
_FOREGROUND = int(Qt.ItemDataRole.ForegroundRole)
_ACCESSIBLE = int(Qt.ItemDataRole.AccessibleTextRole)
_USER = int(Qt.ItemDataRole.UserRole)
_ROLES = frozenset((_DISPLAY, _DECORATION, _TOOLTIP, _ALIGN, _FOREGROUND, _ACCESSIBLE, _USER))
_RIGHT = int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
_LEFT = int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
# widest text each numeric column is sized for (the header may be wider)
_SAMPLES = {2: "9,999", 3: "9,999", 4: "99,999", 5: "9,999", 6: "99.9"}


def _alignment(col: Column) -> int:
    return _RIGHT if col.numeric else _LEFT


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

    def __init__(
        self, parent: Any = None, color_of: Callable[[str], QColor] = colors.accent_color
    ) -> None:
        super().__init__(parent)
        self.color_of = color_of  # a chat's accent colour, as the app shows it
        self._rows: list[Row] = []
        self._icons: dict[str, QIcon] = {}
        self.warning = QColor("#E5484D")
        self.muted = QColor("#8E8E93")
        self.active = QColor("#2DB55D")

    # ---- updates ---------------------------------------------------------------------------

    def update_from(self, snap: Any, name: Callable[[str], str],
                    remote: dict[str, Any] | None = None,
                    queued: dict[str, float] | None = None) -> None:
        """Bring the rows in line with `snap.sessions` (and the remote chats' rows, which
        hold no blocks) with minimal model signals. `queued`: chats the app has asked for a
        reply, and when (time.time()); one that a snapshot older than its request shows
        finished, or not at all, is waiting: its request sits in the engine's inbox while a
        long step runs (it showed "idle", issue 25)."""
        sessions = dict(snap.sessions) if snap is not None else {}
        for sid, stats in (remote or {}).items():
            sessions.setdefault(sid, stats)
        taken_at = getattr(snap, "time", 0.0) if snap is not None else 0.0
        for sid, sent_at in (queued or {}).items():
            stats = sessions.get(sid)
            if stats is None:
                sessions[sid] = _queued_stats(sid)
            elif str(getattr(stats.state, "value", stats.state)) == "finished" \
                    and taken_at < sent_at:
                sessions[sid] = dataclasses.replace(stats, state="waiting", tokens_per_s=0.0)
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
                priority=int(getattr(stats, "priority", 1)),  # remote chats have none
                reason=str(getattr(stats, "waiting_reason", "") or ""),
            )
            i = known.get(sid)
            if i is None:
                new_rows.append(row)
            elif self._rows[i] != row:
                old, self._rows[i] = self._rows[i], row
                # repaint only the cells whose text changed (tok/s moves every refresh)
                changed = [
                    c for c in range(len(COLUMNS)) if self._display(old, c) != self._display(row, c)
                ]
                if old.state != row.state:
                    changed += [CHAT, STATE]
                if changed:
                    self.dataChanged.emit(self.index(i, min(changed)), self.index(i, max(changed)))
        if new_rows:
            first = len(self._rows)
            self.beginInsertRows(QModelIndex(), first, first + len(new_rows) - 1)
            self._rows.extend(new_rows)
            self.endInsertRows()
        self._active_first()

    def _active_first(self) -> None:
        """Chats that are prefilling, decoding or waiting come first (stable otherwise), so
        the busy ones are never hidden below the table's scroll edge."""
        order = sorted(range(len(self._rows)), key=lambda i: self._rows[i].state == "finished")
        if order == list(range(len(self._rows))):
            return
        self.layoutAboutToBeChanged.emit()
        moved = {old: new for new, old in enumerate(order)}
        persistent = self.persistentIndexList()
        self._rows = [self._rows[i] for i in order]
        self.changePersistentIndexList(
            persistent,
            [self.index(moved[ix.row()], ix.column()) for ix in persistent],
        )
        self.layoutChanged.emit()

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
        # Views ask for a dozen roles per cell on every repaint: compare plain ints (Python
        # enum comparisons made this method the panel's top cost) and bail out early.
        role = int(role)
        if role not in _ROLES:
            return None
        r = index.row()
        if not 0 <= r < len(self._rows):
            return None
        row, col = self._rows[r], index.column()
        if role == _DISPLAY:
            return self._display(row, col)
        if role == _ALIGN:
            return _RIGHT if COLUMNS[col].numeric else _LEFT
        if role == _FOREGROUND:
            if col == STATE and row.state == "preempted":
                return self.warning
            if col == STATE and row.state in ("decoding", "prefilling"):
                return self.active
            if row.state == "finished" and col != CHAT:
                return self.muted
            return None
        if role == _DECORATION:
            if col != CHAT:
                return None
            icon = self._icons.get(row.session_id)
            if icon is None:
                icon = self._icons[row.session_id] = _swatch(self.color_of(row.session_id))
            return icon
        if role == _TOOLTIP:
            if col == STATE:
                tip = STATE_TIPS.get(row.state, row.state)
                if row.reason:
                    tip += f"\n{row.reason[0].upper()}{row.reason[1:]}"
                if _live(row):
                    tip += f"\n{PRIORITY_TIPS.get(row.priority, '')}"
                return tip
            if col == CHAT:
                return f"{row.name} ({STATE_LABELS.get(row.state, row.state)})\n" \
                    f"session {row.session_id}\n{STATE_TIPS.get(row.state, '')}"
            return COLUMNS[col].tip
        if role == _ACCESSIBLE:
            return f"{COLUMNS[col].title}: {self._display(row, col)}"
        return row.session_id  # UserRole

    @staticmethod
    def _display(row: Row, col: int) -> str:
        if col == CHAT:
            return row.name
        if col == STATE:
            label = STATE_LABELS.get(row.state, row.state)
            priority = PRIORITY_LABELS.get(row.priority) if _live(row) else None
            return f"{label} · {priority}" if priority else label
        if col == BLOCKS:
            return f"{row.blocks:,}"
        if col == SHARED:
            return f"{row.shared:,}" if row.shared else "–"
        if col == TOKENS:
            return f"{row.tokens:,}"
        if col == WASTE:
            return f"{row.waste:,}"
        if col == RATE:  # an idle chat shows no speed (the engine's 2 s window lingers)
            return fmt_rate(shown_rate(row.rate, row.state))
        return ""


class ChatCellDelegate(QStyledItemDelegate):
    """The chat column on two lines: colour swatch and title, then the state below it.

    A narrow dock cannot give seven columns enough room for titles; folding the state under
    the title (the State column stays in the model, hidden in the view) keeps titles legible.
    """

    def _fonts(self, option: QStyleOptionViewItem) -> tuple[QFont, QFont]:
        key = option.font.key()
        if key != self._font_key:
            small = QFont(option.font)
            small.setPointSizeF(max(6.5, option.font.pointSizeF() * 0.88))
            self._font_key, self._font_pair = key, (QFont(option.font), small)
        return self._font_pair

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._font_key = ""
        self._font_pair: tuple[QFont, QFont] = (QFont(), QFont())

    def sizeHint(self, option: QStyleOptionViewItem, index: Index) -> QSize:
        title, small = self._fonts(option)
        h = QFontMetrics(title).height() + QFontMetrics(small).height() + 8
        return QSize(120, h)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: Index) -> None:
        # Painted directly (no initStyleOption / style.drawControl: they cost more than the
        # rest of the legend together at 10 Hz); the selection background matches the others.
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        pal = option.palette
        if selected:
            painter.fillRect(option.rect, pal.color(QPalette.ColorRole.Highlight))
        model = index.model()
        text = model.data(index, Qt.ItemDataRole.DisplayRole) or ""
        title_font, small_font = self._fonts(option)
        rect = option.rect.adjusted(6, 3, -4, -3)
        fg = pal.color(QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.Text)
        sid = model.data(index, Qt.ItemDataRole.UserRole)
        state_index = model.index(index.row(), STATE)
        state = model.data(state_index, Qt.ItemDataRole.DisplayRole) or ""
        state_color = model.data(state_index, Qt.ItemDataRole.ForegroundRole)
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(model.color_of(str(sid)))
        fm = QFontMetrics(title_font)
        painter.drawRoundedRect(QRect(rect.left(), rect.top() + (fm.height() - 10) // 2, 10, 10),
                                3, 3)
        text_rect = rect.adjusted(16, 0, 0, 0)
        painter.setFont(title_font)
        painter.setPen(fg)
        painter.drawText(
            text_rect.adjusted(0, 0, 0, -(rect.height() - fm.height())),
            int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter),
            fm.elidedText(str(text), Qt.TextElideMode.ElideRight, text_rect.width()),
        )
        painter.setFont(small_font)
        muted = QColor(state_color) if isinstance(state_color, QColor) else QColor(
            pal.color(QPalette.ColorRole.PlaceholderText)
        )
        painter.setPen(fg if selected else muted)
        painter.drawText(
            text_rect.adjusted(0, fm.height(), 0, 0),
            int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter),
            state,
        )
        painter.restore()


class NumberDelegate(QStyledItemDelegate):
    """Right-aligned numbers painted directly (the default delegate asks the model for a
    dozen roles and runs the style for every cell: most of the legend's 10 Hz cost)."""

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: Index) -> None:
        pal = option.palette
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        if selected:
            painter.fillRect(option.rect, pal.color(QPalette.ColorRole.Highlight))
            color = pal.color(QPalette.ColorRole.HighlightedText)
        else:
            fg = index.model().data(index, Qt.ItemDataRole.ForegroundRole)
            color = fg if isinstance(fg, QColor) else pal.color(QPalette.ColorRole.Text)
        painter.save()
        painter.setFont(option.font)
        painter.setPen(color)
        painter.drawText(
            option.rect.adjusted(2, 0, -6, 0),
            _RIGHT,
            str(index.model().data(index, Qt.ItemDataRole.DisplayRole) or ""),
        )
        painter.restore()


class LegendView(QTableView):
    """The legend table; a click selects (and toggles) a chat, hovering reports it."""

    sessionClicked = Signal(object)  # session id, or None when the selection was cleared
    sessionHovered = Signal(object)  # session id, or None

    def __init__(self, model: LegendModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("monitorLegend")
        self.setTabKeyNavigation(False)  # Tab leaves the table (arrows move in it), no trap
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
        # fixed widths from the font, not ResizeToContents: that mode re-measures every cell
        # on each dataChanged, thousands of data() calls per 10 Hz refresh
        header.setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        header.setSectionResizeMode(CHAT, QHeaderView.ResizeMode.Stretch)
        header.setMinimumSectionSize(30)
        self.setFrameShape(QTableView.Shape.NoFrame)
        font = self.font()
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.9))
        self.setFont(font)
        header.setFont(font)
        self._size_columns()
        self.setItemDelegateForColumn(CHAT, ChatCellDelegate(self))
        self._numbers = NumberDelegate(self)
        for col in _SAMPLES:
            self.setItemDelegateForColumn(col, self._numbers)
        self.setColumnHidden(STATE, True)  # shown under the title by ChatCellDelegate
        small = QFont(font)
        small.setPointSizeF(max(6.5, font.pointSizeF() * 0.88))
        self.verticalHeader().setDefaultSectionSize(
            self.fontMetrics().height() + QFontMetrics(small).height() + 8
        )
        self._hovered: str | None = None
        self._selected: str | None = None
        self.clicked.connect(self._clicked)
        self.entered.connect(self._entered)
        model.rowsInserted.connect(self.fit_rows)
        model.rowsRemoved.connect(self.fit_rows)
        self.fit_rows()

    def _size_columns(self) -> None:
        fm = QFontMetrics(self.horizontalHeader().font())
        for col, sample in _SAMPLES.items():
            width = max(fm.horizontalAdvance(COLUMNS[col].title), fm.horizontalAdvance(sample))
            self.setColumnWidth(col, width + 14)

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
