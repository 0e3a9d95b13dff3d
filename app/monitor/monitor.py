"""The KV monitor panel: block map, key, legend, counters and timeline, fed by snapshots.

The panel only reads immutable `PoolSnapshot`s that the bridge polls at 10 Hz
(`snapshotUpdated`), so it can never block or slow the engine thread. It wires the parts
together: selecting a chat (legend row or one of its blocks) highlights its blocks and focuses
its pane; hovering a pane or a legend row highlights that chat while the pointer stays. What it
knows of the chats (titles, colours, focus, pane hover) it asks the Chats it is handed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QFont, QPainter, QPalette
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QSizePolicy,
    QStackedWidget,
    QStyle,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.monitor.block_map import BlockMap, BlockMapArea
from app.monitor.chats import Chats, NoChats
from app.monitor.counters import (
    MIB,
    CapacityBar,
    CountersWidget,
    PoolCounters,
    fmt_mib,
    pool_counters,
)
from app.monitor.key import MapKey
from app.monitor.legend import LegendModel, LegendView
from app.monitor.pool_state import PoolState
from app.monitor.timeline import TimelineWidget
from app.ui import icons

WAITING, CONTENT, NOT_PAGED = range(3)
MIN_SIDE = 64  # px: the panel's minimum width and height; narrower or shorter, it scrolls


def _heading(text: str) -> QLabel:
    label = QLabel(text)
    label.setObjectName("monitorHeading")
    font = QFont(label.font())
    font.setBold(True)
    font.setPointSizeF(max(7.0, font.pointSizeF() * 0.85))
    font.setCapitalization(QFont.Capitalization.AllUppercase)
    font.setLetterSpacing(QFont.SpacingType.PercentageSpacing, 106)
    label.setFont(font)
    label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
    return label


class ElidedLabel(QLabel):
    """A label that shrinks with its dock and ends its text with "…" instead of clipping."""

    def minimumSizeHint(self) -> QSize:
        return QSize(0, super().minimumSizeHint().height())

    def paintEvent(self, event: Any) -> None:
        p = QPainter(self)
        p.setPen(self.palette().color(self.foregroundRole()))
        p.setFont(self.font())
        text = self.fontMetrics().elidedText(
            self.text(), Qt.TextElideMode.ElideRight, self.contentsRect().width()
        )
        p.drawText(self.contentsRect(), int(self.alignment()), text)
        p.end()


def _small(label: QLabel, scale: float = 0.9) -> QLabel:
    font = QFont(label.font())
    font.setPointSizeF(max(7.0, font.pointSizeF() * scale))
    label.setFont(font)
    return label


class _Sections(QWidget):
    """The panel's sections, inside its scroll area. QScrollArea sizes a widget whose layout
    has a height-for-width part (the map key wraps) to that layout's *preferred* height, so
    at 860 px the monitor scrolled by what the block map could have given up; this asks for
    the minimum height at the width instead (the block map then takes what is left)."""

    key: QWidget | None = None

    def heightForWidth(self, width: int) -> int:
        layout = self.layout()
        height = layout.minimumSize().height()
        if self.key is not None:
            m = layout.contentsMargins()
            wrapped = self.key.heightForWidth(width - m.left() - m.right())
            height += max(0, wrapped - max(0, self.key.minimumSizeHint().height()))
        return height


class MonitorPanel(QWidget):
    def __init__(
        self, bridge: Any, chats: Chats | None = None, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.setObjectName("kvMonitor")
        self.setAccessibleName("KV cache monitor")
        self.setBackgroundRole(QPalette.ColorRole.Base)
        self.setAutoFillBackground(True)
        self.bridge = bridge
        self.chats: Chats = chats if chats is not None else NoChats(self)
        self._snap: Any = None
        self._counters: PoolCounters | None = None
        self._state: PoolState | None = None
        self._selected: str | None = None
        self._hovered: str | None = None
        self._build()
        self.chats.chatHovered.connect(self._pane_hovered)
        bridge.snapshotUpdated.connect(self.show_snapshot)
        if bridge.latest_snapshot is not None:
            self.show_snapshot(bridge.latest_snapshot)

    def sizeHint(self) -> QSize:
        # wide enough for the counters in two columns even beside a vertical scroll bar: a
        # bar that squeezed them into one column made them taller, which kept the bar
        bar = self.style().pixelMetric(QStyle.PixelMetric.PM_ScrollBarExtent, None, self)
        return QSize(404 + bar, 760)

    def minimumSizeHint(self) -> QSize:
        # A window's minimum size includes its docks': the sections' own ~210 x 550 px kept
        # a window with four panes from shrinking to 800x600 (issue 11, item 4). The panel
        # scrolls instead (self.scroll), so it can yield nearly all its room to the chats.
        return QSize(MIN_SIDE, MIN_SIDE)

    # ---- construction ----------------------------------------------------------------------

    def _build(self) -> None:
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        self.pages = QStackedWidget(self)
        outer.addWidget(self.pages)

        self.waiting_label = QLabel("Waiting for the model…")
        self.waiting_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.waiting_label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.pages.addWidget(self.waiting_label)

        content = _Sections()
        # scrolled, so the panel's minimum size can be small (see minimumSizeHint)
        self.scroll = QScrollArea(self)
        self.scroll.setObjectName("monitorScroll")
        self.scroll.setAccessibleName("KV monitor, scrollable")  # a Tab stop: arrows scroll it
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setWidgetResizable(True)
        self.scroll.setBackgroundRole(QPalette.ColorRole.Base)
        self.scroll.setWidget(content)
        self.pages.addWidget(self.scroll)
        v = QVBoxLayout(content)
        v.setContentsMargins(10, 8, 10, 10)
        v.setSpacing(5)

        head = QHBoxLayout()
        head.setSpacing(4)
        head.addWidget(_heading("Block pool"))
        self.summary = _small(ElidedLabel(), 0.85)
        self.summary.setObjectName("monitorSummary")
        self.summary.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.summary.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.summary.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        head.addWidget(self.summary, 1)
        self.zoom_label = _small(QLabel(), 0.85)
        self.zoom_label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.zoom_label.setAccessibleName("Blocks per cell")
        head.addWidget(self.zoom_label)
        minus = icons.drawable("−", "-")  # a graceful substitute in a font without it
        self.zoom_out_button = self._tool(minus, "Zoom out of the block map", f"Zoom out ({minus})")
        self.zoom_fit_button = self._tool("Fit", "Fit the whole pool", "Show every block (0)")
        self.zoom_in_button = self._tool("+", "Zoom into the block map", "Zoom in (+, Ctrl+wheel)")
        for b in (self.zoom_out_button, self.zoom_fit_button, self.zoom_in_button):
            head.addWidget(b)
        v.addLayout(head)
        self.capacity = CapacityBar()
        v.addWidget(self.capacity)
        self.block_map = BlockMap()
        self.block_map.set_name_resolver(self.title)
        self.block_map.set_color_resolver(self.chats.chat_color)
        self.block_map.set_decoder(self._decode)
        self.map_area = BlockMapArea(self.block_map)
        self.map_area.setBackgroundRole(QPalette.ColorRole.Base)
        v.addWidget(self.map_area, 1)
        self.key = MapKey()
        content.key = self.key
        v.addWidget(self.key)

        v.addSpacing(6)
        v.addWidget(_heading("Chats"))
        self.legend_model = LegendModel(self, color_of=self.chats.chat_color)
        self.legend = LegendView(self.legend_model)
        self.legend.setBackgroundRole(QPalette.ColorRole.Base)
        v.addWidget(self.legend)

        v.addSpacing(6)
        v.addWidget(_heading("Pool counters"))
        self.counters = CountersWidget()
        for label in self.counters.findChildren(QLabel):
            _small(label, 0.92)
            if label.objectName() == "counterLabel":
                label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.counters.refit()
        v.addWidget(self.counters)

        v.addSpacing(6)
        v.addWidget(_heading("Last 60 s"))
        self.timeline = TimelineWidget()
        self.timeline.setFixedHeight(112)
        v.addWidget(self.timeline)

        self.not_paged = QLabel()
        self.not_paged.setObjectName("monitorNotPaged")
        self.not_paged.setAccessibleName("KV cache monitor: this model is not paged")
        self.not_paged.setWordWrap(True)
        self.not_paged.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.not_paged.setMargin(16)
        self.not_paged.setTextFormat(Qt.TextFormat.PlainText)
        self.pages.addWidget(self.not_paged)

        self.zoom_out_button.clicked.connect(self.block_map.zoom_out)
        self.zoom_fit_button.clicked.connect(self.block_map.zoom_fit)
        self.zoom_in_button.clicked.connect(self.block_map.zoom_in)
        self.block_map.gridChanged.connect(self._update_zoom_label)
        self.block_map.blockClicked.connect(self._block_clicked)
        self.legend.sessionClicked.connect(self._legend_clicked)
        self.legend.sessionHovered.connect(self._legend_hovered)
        self.pages.setCurrentIndex(WAITING)

    def _tool(self, text: str, name: str, tip: str) -> QToolButton:
        b = QToolButton()
        b.setText(text)
        b.setAccessibleName(name)
        b.setToolTip(tip)
        b.setAutoRaise(True)
        b.setMinimumWidth(26)
        return b

    # ---- snapshots -------------------------------------------------------------------------

    def show_snapshot(self, snap: Any) -> None:
        """Show one snapshot (called at ~10 Hz; an unchanged snapshot only adds a sample).

        While the dock is hidden only the counters and the timeline keep up (so its history
        has no hole); the map and the legend catch up when it is shown again.
        """
        if snap is None:
            self.pages.setCurrentIndex(WAITING)
            return
        if not getattr(snap, "paged", True):
            self._show_not_paged(snap)
            return
        if self.pages.currentIndex() != CONTENT:
            self.pages.setCurrentIndex(CONTENT)
        if snap is not self._snap:
            self._snap = snap
            self._state = PoolState(snap, self.block_map.sessions)
            self._counters = pool_counters(self._state)
        visible = self.isVisible()
        if visible:
            self._present(animate=True)
        c = self._counters
        assert c is not None
        self.timeline.add(c.used, c.cached, c.shared, c.tokens_per_s, c.num_blocks)

    def _show_not_paged(self, snap: Any) -> None:
        """A model on mlx-lm's own cache (engine/runner/fallback.py) has no block pool to draw:
        say so, and what still holds (one batch for every chat), with its live numbers."""
        info = getattr(self.bridge, "model_info", None)
        reason = getattr(info, "not_paged_reason", "") if info is not None else ""
        live = [s for s in snap.sessions.values() if s.requests]
        text = (
            f"{snap.model_name or 'This model'} is not paged.\n\n"
            "Its architecture does not run on PagedChat's block pool, so it runs on "
            "mlx-lm's own KV cache: chats are still batched together, but there are no "
            "blocks, no prefix sharing and no copy-on-write to show.\n\n"
            f"{len(live)} chat{'s' if len(live) != 1 else ''} generating · "
            f"{snap.counters.tokens_per_s:.1f} tok/s · "
            f"{sum(s.tokens_in_context for s in live):,} tokens in context"
        )
        if text != self.not_paged.text():
            self.not_paged.setText(text)
            self.not_paged.setToolTip(reason)
        if self.pages.currentIndex() != NOT_PAGED:
            self.pages.setCurrentIndex(NOT_PAGED)
        self._snap, self._state, self._counters = snap, None, None  # nothing for _present

    def _present(self, animate: bool) -> None:
        """Bring the map, legend, counters and summary in line with the latest snapshot."""
        snap, state, c = self._snap, self._state, self._counters
        if snap is None or state is None or c is None:
            return
        if self.block_map.snapshot is not snap:
            self.block_map.set_snapshot(snap, state, animate=animate)
            self.counters.set_counters(c)
            self._update_capacity(state)
            self._update_summary(snap)
            described = (
                f"{c.num_blocks:,} blocks: {c.used:,} used ({c.shared:,} shared), "
                f"{c.cached:,} cached, {c.free:,} free"
            )
            if described != self.block_map.accessibleDescription():
                self.block_map.setAccessibleDescription(described)
        remote = getattr(self.chats, "remote_sessions", None)
        queued = getattr(self.chats, "queued_sessions", None)
        self.legend_model.update_from(snap, self.title, remote() if remote else None,
                                      queued() if queued else None)

    def showEvent(self, event: Any) -> None:
        super().showEvent(event)
        self._present(animate=False)

    def block_map_state(self) -> PoolState | None:
        """The derived state of the snapshot the map shows (None before the first one)."""
        return self.block_map.state

    def _update_capacity(self, state: PoolState) -> None:
        used = state.primary[state.used_mask()]
        counts = np.bincount(used[used >= 0], minlength=len(self.block_map.sessions))
        ids = self.block_map.sessions.ids
        segments = [
            (self.chats.chat_color(ids[i]), int(n)) for i, n in enumerate(counts.tolist()) if n
        ]
        cached = self._counters.cached if self._counters is not None else 0
        self.capacity.set_segments(segments, cached, state.num_blocks)

    def _update_summary(self, snap: Any) -> None:
        text = (
            f"{snap.num_blocks:,} × {snap.block_size} tok · "
            f"{fmt_mib(snap.bytes_per_block * snap.num_blocks / MIB)}"
        )
        full = getattr(snap, "full_bytes_per_block", 0)
        eight_bit = full > snap.bytes_per_block  # an 8-bit pool (issue #26)
        if eight_bit:
            text += f" · 8-bit, {fmt_mib(snap.saved_bytes / MIB)} saved"
        if text != self.summary.text():
            self.summary.setText(text)
            self.summary.setToolTip(
                f"{snap.num_blocks:,} blocks of {snap.block_size} token slots; "
                f"{snap.bytes_per_block / 1024:,.0f} KiB per block (K and V, every layer"
                + (f", {snap.kv_dtype}" if getattr(snap, "kv_dtype", "") else "") + ")"
                + (f"\n8-bit K/V: {full / 1024:,.0f} KiB per block at the model's own "
                   f"precision; the used blocks save {fmt_mib(snap.saved_bytes / MIB)}"
                   if eight_bit else "")
                + (f"\nmodel: {snap.model_name}" if snap.model_name else "")
            )

    def _update_zoom_label(self) -> None:
        g = self.block_map.grid
        if g is None:
            return
        self.zoom_label.setText(
            "1 block/cell" if g.per_cell == 1 else f"{g.per_cell} blocks/cell"
        )
        self.zoom_in_button.setEnabled(g.can_zoom_in)
        self.zoom_out_button.setEnabled(g.zoom > 0)
        self.zoom_fit_button.setEnabled(g.zoom > 0)

    def _decode(self, tokens: tuple[int, ...]) -> str:
        engine = self.bridge.engine
        return engine.decode(tokens) if engine is not None else ""

    def title(self, session_id: str) -> str:
        """The chat's title, or its session id when the app does not know the session."""
        return self.chats.chat_title(session_id) or session_id

    # ---- selection and hover ---------------------------------------------------------------

    def select_session(self, session_id: str | None, focus_pane: bool = True) -> None:
        """Highlight a chat's blocks (None clears) and focus its pane if it is open."""
        self._selected = session_id
        self.legend.select_session(session_id)
        self._apply_highlight()
        if session_id is not None and focus_pane:
            self.chats.focus_chat(session_id)

    def _legend_clicked(self, session_id: str | None) -> None:
        self._selected = session_id
        self._apply_highlight()
        if session_id is not None:
            self.chats.focus_chat(session_id)

    def _legend_hovered(self, session_id: str | None) -> None:
        self._hovered = session_id
        self._apply_highlight()

    def _pane_hovered(self, session_id: str | None) -> None:
        self._hovered = session_id
        self._apply_highlight()

    def _block_clicked(self, block: int) -> None:
        state = self.block_map_state()
        owners = state.block(block).owners if state is not None and block >= 0 else ()
        self.select_session(owners[0] if owners else None)

    def _apply_highlight(self) -> None:
        self.block_map.set_highlight(self._hovered or self._selected)

    @property
    def highlighted(self) -> str | None:
        return self.block_map.highlight
