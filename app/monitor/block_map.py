"""The block map: every physical KV block of the pool as a cell, in block-id order.

One custom QWidget paints the whole pool (no widget or graphics item per block). The cells are
rasterised with numpy into a cached QImage (app/monitor/raster.py), rebuilt only when the
snapshot, the highlighted chat, the zoom, the size or the theme changes, and only for the rows
on screen; a paint event then costs one drawImage plus the short-lived overlays: the flash of
freshly allocated or freed blocks (fading over FLASH_S) and the hover ring.

Read back what was drawn with `cell_state(block_id)`, `cell_rect(block_id)` and
`drawn_color(block_id)` (tests compare them with the engine's snapshot).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from PySide6.QtCore import QEvent, QPoint, QRect, QRectF, QSize, Qt, QTimer, Signal
from PySide6.QtGui import (
    QColor,
    QFont,
    QHelpEvent,
    QImage,
    QKeyEvent,
    QMouseEvent,
    QPainter,
    QPaintEvent,
    QPen,
    QWheelEvent,
)
from PySide6.QtWidgets import QFrame, QScrollArea, QToolTip, QWidget

from app.monitor import cell_colors, style
from app.monitor.grid import Grid, fit_grid
from app.monitor.pool_state import (
    FREE,
    HELD,
    BlockState,
    Cells,
    PoolState,
    SessionIndex,
    aggregate,
)
from app.monitor.raster import rasterize, rasterize_rows
from app.monitor.tooltip import block_tooltip, cell_tooltip
from app.ui import colors

FLASH_S = 0.5  # how long a freshly allocated / freed block stays highlighted
FRAME_MS = 33  # animation frame interval while flashes fade
MARGIN = 6  # logical px around the grid
BADGE_MIN_CELL = 15  # logical px: from this cell size on, shared cells show their refcount
ROW_SLACK = 8  # rows rasterised beyond the visible ones, so small scrolls reuse the image

ALLOCATED, FREED = 1, 2


class BlockMap(QWidget):
    """Paints a PoolSnapshot; see the module docstring."""

    blockClicked = Signal(int)  # first block of the clicked cell
    hoveredBlockChanged = Signal(int)  # first block of the hovered cell, -1 for none
    gridChanged = Signal()  # zoom or blocks-per-cell changed

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("blockMap")
        self.setAccessibleName("KV block map")
        self.setAccessibleDescription(
            "Every KV block of the pool, in block-id order, coloured by the chat holding it."
        )
        self.setMouseTracking(True)
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent, True)
        self.sessions = SessionIndex()
        self._snap: Any = None
        self._state: PoolState | None = None
        self._cells: Cells | None = None
        self._grid: Grid | None = None
        self._zoom = 0
        self._viewport = QSize(0, 0)
        self._highlight: str | None = None
        self._name: Callable[[str], str] = lambda sid: sid
        self._decode: Callable[[tuple[int, ...]], str] | None = None
        self._palette: cell_colors.Palette | None = None
        self._color_signature: tuple[int, ...] = ()
        self._color_of: Callable[[str], QColor] = colors.accent_color
        self._palette_version = 0
        self._plan: Any = None
        self._image: QImage | None = None
        self._image_buf: np.ndarray | None = None
        self._image_rows = (0, 0)
        self._flash_buf: np.ndarray | None = None
        self._image_key: tuple[Any, ...] = ()
        self._dirty_rows: set[int] = set()
        self._last_owner = np.zeros(0, dtype=np.int32)
        self._flash_t = np.zeros(0, dtype=np.float64)
        self._flash_kind = np.zeros(0, dtype=np.int8)
        self._flash_owner = np.zeros(0, dtype=np.int32)
        self._hover_cell = -1
        self.clock: Callable[[], float] = time.monotonic
        self._anim = QTimer(self)
        self._anim.setInterval(FRAME_MS)
        self._anim.timeout.connect(self._animate)

    # ---- inputs ----------------------------------------------------------------------------

    def set_name_resolver(self, name: Callable[[str], str]) -> None:
        """How a session id is shown (the chat title when the app knows it)."""
        self._name = name

    def set_color_resolver(self, color_of: Callable[[str], QColor]) -> None:
        """A session id's accent colour (the chat's, as the app shows it)."""
        self._color_of = color_of
        self._replan()

    def set_decoder(self, decode: Callable[[tuple[int, ...]], str] | None) -> None:
        """Token ids -> text for tooltips (the engine's public `decode`)."""
        self._decode = decode

    def set_snapshot(
        self, snap: Any, state: PoolState | None = None, animate: bool = True
    ) -> None:
        """Show a new snapshot; the same object again (an idle engine) costs nothing.

        `state` may be passed when the caller already derived it (with this map's
        `sessions`); `animate=False` skips the flashes (catching up after being hidden).
        """
        if snap is None or snap is self._snap:
            return
        previous = self._state
        if state is None or state.snapshot is not snap:
            state = PoolState(snap, self.sessions)
        if previous is None or previous.num_blocks != state.num_blocks:
            n = state.num_blocks
            self._last_owner = np.full(n, -1, dtype=np.int32)
            self._flash_t = np.full(n, -np.inf)
            self._flash_kind = np.zeros(n, dtype=np.int8)
            self._flash_owner = np.full(n, -1, dtype=np.int32)
            previous = None
            self._grid = None
        if previous is not None and animate:
            self._start_flashes(previous, state)
        self._last_owner = np.where(
            state.primary >= 0,
            state.primary,
            np.where(state.category == FREE, -1, self._last_owner),
        ).astype(np.int32)
        self._snap, self._state = snap, state
        if self._grid is None:
            self._relayout()
        self._rebuild_cells()

    def set_highlight(self, session_id: str | None) -> None:
        """Keep one chat's blocks in colour and fade the rest (None: no highlight)."""
        if session_id == self._highlight:
            return
        self._highlight = session_id
        self._replan()

    @property
    def highlight(self) -> str | None:
        return self._highlight

    @property
    def snapshot(self) -> Any:
        return self._snap

    @property
    def state(self) -> PoolState | None:
        return self._state

    @property
    def grid(self) -> Grid | None:
        return self._grid

    @property
    def cells(self) -> Cells | None:
        return self._cells

    # ---- zoom and geometry -----------------------------------------------------------------

    def set_viewport_size(self, size: QSize) -> None:
        """The visible area (the scroll area's viewport): the grid fits it at zoom 0."""
        if size == self._viewport:
            return
        self._viewport = QSize(size)
        self._relayout()

    def zoom_in(self) -> None:
        if self._grid is None or self._grid.can_zoom_in:
            self.set_zoom(self._zoom + 1)

    def zoom_out(self) -> None:
        self.set_zoom(self._zoom - 1)

    def zoom_fit(self) -> None:
        self.set_zoom(0)

    @property
    def zoom(self) -> int:
        return self._zoom

    def set_zoom(self, zoom: int) -> None:
        zoom = max(0, int(zoom))
        if zoom == self._zoom:
            return
        self._zoom = zoom
        self._relayout()

    def _relayout(self) -> None:
        dpr = self.devicePixelRatioF()
        view = self._viewport if not self._viewport.isEmpty() else self.size()
        width = max(1, view.width() - 2 * MARGIN)
        height = max(1, view.height() - 2 * MARGIN)
        n = self._state.num_blocks if self._state is not None else 0
        grid = fit_grid(n, round(width * dpr), round(height * dpr), dpr, self._zoom)
        self._zoom = grid.zoom
        changed = grid != self._grid
        self._grid = grid
        if grid.zoom > 0:
            self.setMinimumHeight(int(np.ceil(grid.height / dpr)) + 2 * MARGIN)
        else:
            self.setMinimumHeight(0)
        if changed:
            self._rebuild_cells()
            self.gridChanged.emit()

    def _rebuild_cells(self) -> None:
        if self._state is None or self._grid is None:
            self._cells = None
            self._invalidate()
            return
        self._cells = aggregate(
            self._state, self._grid.per_cell, len(self.sessions), self._last_owner
        )
        self._replan()

    def _replan(self) -> None:
        cells, grid = self._cells, self._grid
        if cells is None or grid is None or self._state is None:
            self._plan = None
            self._invalidate()
            return
        palette = self._palette
        signature = tuple(self._color_of(sid).rgba() for sid in self.sessions.ids)
        if palette is None or signature != self._color_signature:
            palette = self._palette = style.map_palette(
                self.palette(), self.sessions.ids, self._color_of
            )
            self._color_signature = signature
            self._palette_version += 1
        highlight = None
        if self._highlight is not None:
            index = (
                self.sessions.index(self._highlight) if self._highlight in self.sessions else -1
            )
            held = self._state.held_by(index, self.sessions)
            if cells.per_cell > 1:
                pad = cells.count * cells.per_cell - held.shape[0]
                held = np.concatenate([held, np.zeros(pad, dtype=bool)])
                held = held.reshape(cells.count, cells.per_cell).any(axis=1)
            highlight = held
        previous = self._plan
        self._plan = cell_colors.plan(
            cells,
            self._state.block_size,
            palette,
            grid.cell_size,
            highlight,
            corner_marks=not self._badges(),
        )
        key = (grid, self._palette_version, self._badges())
        if self._image is None or previous is None or key != self._image_key:
            self._image_key = key
            self._invalidate()
            return
        # same geometry and colours: re-rasterise only the rows whose cells changed
        changed = cell_colors.changed_cells(previous, self._plan)
        rows = np.unique(np.nonzero(changed)[0] // grid.cols)
        if len(rows):
            self._dirty_rows.update(rows.tolist())
            self.update()

    def _badges(self) -> bool:
        """Large single-block cells show a refcount badge instead of a corner mark."""
        g = self._grid
        return (
            g is not None
            and g.per_cell == 1
            and g.cell_size / self.devicePixelRatioF() >= BADGE_MIN_CELL
        )

    def _invalidate(self) -> None:
        self._image = None
        self._image_buf = None
        self._dirty_rows.clear()
        self.update()

    # ---- flashes ---------------------------------------------------------------------------

    def _start_flashes(self, before: PoolState, after: PoolState) -> None:
        was_used = before.category >= HELD
        now_used = after.category >= HELD
        allocated = np.nonzero(now_used & ~was_used)[0]
        freed = np.nonzero(was_used & ~now_used)[0]
        if not len(allocated) and not len(freed):
            return
        t = self.clock()
        self._flash_t[allocated] = t
        self._flash_kind[allocated] = ALLOCATED
        self._flash_t[freed] = t
        self._flash_kind[freed] = FREED
        self._flash_owner[freed] = before.primary[freed]
        if not self._anim.isActive():
            self._anim.start()

    def _animate(self) -> None:
        if not np.any(self.clock() - self._flash_t < FLASH_S):
            self._anim.stop()
        self.update()

    def flashing_blocks(self) -> dict[int, str]:
        """Blocks currently flashing -> "allocated" / "freed" (for tests and the key)."""
        active = np.nonzero(self.clock() - self._flash_t < FLASH_S)[0]
        names = {ALLOCATED: "allocated", FREED: "freed"}
        return {int(b): names[int(self._flash_kind[b])] for b in active}

    # ---- read-back API ---------------------------------------------------------------------

    def cell_state(self, block_id: int) -> BlockState:
        """What the map drew for a block: category, owners, refcount, fill, cached flag."""
        if self._state is None:
            raise LookupError("no snapshot shown yet")
        return self._state.block(block_id)

    def cell_of(self, block_id: int) -> int:
        if self._grid is None:
            return -1
        return int(block_id) // self._grid.per_cell

    def cell_rect(self, block_id: int) -> QRect:
        """The cell showing this block, in widget coordinates (logical px)."""
        g = self._grid
        if g is None:
            return QRect()
        x, y = g.cell_origin(self.cell_of(block_id))
        dpr = self.devicePixelRatioF()
        return QRect(
            MARGIN + int(x / dpr),
            MARGIN + int(y / dpr),
            max(1, int(g.cell_size / dpr)),
            max(1, int(g.cell_size / dpr)),
        )

    def block_at(self, pos: QPoint) -> int:
        """First block of the cell under a widget position, or -1."""
        g = self._grid
        if g is None:
            return -1
        dpr = self.devicePixelRatioF()
        cell = g.cell_at(int((pos.x() - MARGIN) * dpr), int((pos.y() - MARGIN) * dpr))
        return cell * g.per_cell if cell >= 0 else -1

    def drawn_color(self, block_id: int) -> QColor:
        """The pixel drawn at the bottom-left inside the block's cell (the filled band)."""
        g = self._grid
        if g is None or self._plan is None:
            return QColor()
        cell = self.cell_of(block_id)
        row = cell // g.cols
        self._ensure_image(row, row + 1)
        x, y = g.cell_origin(cell)
        size = g.cell_size
        px = x + min(1, size - 1)
        py = y - self._image_rows[0] * g.pitch + size - 1 - min(1, size - 1)
        assert self._image_buf is not None
        return style.from_rgb32(int(self._image_buf[py, px]))

    def tooltip_text(self, block_id: int) -> str:
        """The tooltip of the cell holding this block (decodes its text: call on hover only)."""
        if self._state is None or self._cells is None or not 0 <= block_id < self._state.num_blocks:
            return ""
        if self._cells.per_cell == 1:
            return block_tooltip(self._state, block_id, self._name, self._decode)
        return cell_tooltip(self._state, self._cells, self.cell_of(block_id), self._name)

    # ---- painting --------------------------------------------------------------------------

    def _ensure_image(self, row0: int, row1: int) -> None:
        """Make the cached image cover grid rows [row0, row1), redrawing only dirty rows."""
        g = self._grid
        if g is None or self._plan is None:
            return
        r0, r1 = self._image_rows
        if self._image is not None and r0 <= row0 and row1 <= r1:
            self._redraw_dirty_rows()
            return
        want0, want1 = self._visible_rows()
        row0 = max(0, min(row0, want0) - ROW_SLACK)
        row1 = min(g.rows, max(row1, want1) + ROW_SLACK)
        buf = self._rasterize(row0, row1)
        h, w = buf.shape
        image = QImage(buf.data, w, h, w * 4, QImage.Format.Format_RGB32)
        image.setDevicePixelRatio(self.devicePixelRatioF())
        self._image_buf, self._image, self._image_rows = buf, image, (row0, row1)
        self._dirty_rows.clear()
        if self._badges():
            self._draw_badges(image, row0, row0, row1)

    def _rasterize(self, row0: int, row1: int) -> np.ndarray:
        g, palette, plan = self._grid, self._palette, self._plan
        assert g is not None and palette is not None and plan is not None
        return rasterize(
            plan,
            g,
            row0,
            row1,
            palette.background,
            palette.mark,
            stripe=max(2, round(2 * self.devicePixelRatioF())),
        )

    def _redraw_dirty_rows(self) -> None:
        g, buf, image = self._grid, self._image_buf, self._image
        if not self._dirty_rows or g is None or buf is None or image is None:
            return
        r0, r1 = self._image_rows
        rows = np.array(sorted(r for r in self._dirty_rows if r0 <= r < r1), dtype=np.int64)
        self._dirty_rows.clear()
        if not len(rows):
            return
        palette = self._palette
        assert palette is not None and self._plan is not None
        pixels = rasterize_rows(
            self._plan,
            g,
            rows,
            palette.background,
            palette.mark,
            stripe=max(2, round(2 * self.devicePixelRatioF())),
        )
        tiles = buf.reshape(r1 - r0, g.pitch, buf.shape[1])
        tiles[rows - r0] = pixels.reshape(len(rows), g.pitch, buf.shape[1])
        if self._badges():
            for r in rows.tolist():
                self._draw_badges(image, r0, r, r + 1)

    def _visible_rows(self) -> tuple[int, int]:
        g = self._grid
        if g is None:
            return 0, 0
        rect = self.visibleRegion().boundingRect()
        if rect.isEmpty():
            rect = self.rect()
        return self._rows_of(rect)

    def _rows_of(self, rect: QRect) -> tuple[int, int]:
        g = self._grid
        assert g is not None
        dpr = self.devicePixelRatioF()
        top = max(0, int((rect.top() - MARGIN) * dpr) // g.pitch)
        bottom = int((rect.bottom() + 1 - MARGIN) * dpr) // g.pitch + 1
        return top, min(g.rows, max(top, bottom))

    def _draw_badges(self, image: QImage, image_row0: int, row0: int, row1: int) -> None:
        """Refcount badges on shared cells of rows [row0, row1) (large cells only), drawn
        once into the image (whose first row is grid row `image_row0`)."""
        g, cells, palette = self._grid, self._cells, self._palette
        assert g is not None and cells is not None and palette is not None
        first, last = row0 * g.cols, min(row1 * g.cols, g.cells)
        shared = np.nonzero(cells.max_ref[first:last] > 1)[0] + first
        if not len(shared):
            return
        if self._highlight is not None and self._plan is not None:
            shared = [c for c in shared if self._plan.c3[c] == palette.empty]
        dpr = self.devicePixelRatioF()
        p = QPainter(image)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.setRenderHint(QPainter.RenderHint.TextAntialiasing)
        size = g.cell_size / dpr
        font = QFont(self.font())
        font.setPixelSize(max(8, int(size * 0.5)))
        font.setBold(True)
        p.setFont(font)
        badge_bg = style.from_rgb32(palette.mark)
        badge_fg = style.from_rgb32(palette.background)
        for cell in shared:
            x, y = g.cell_origin(int(cell))
            ref = int(cells.max_ref[cell])
            text = str(ref) if ref < 100 else "99+"
            w = max(size * 0.52, font.pixelSize() * 0.62 * len(text) + 3)
            h = font.pixelSize() + 2
            rect = QRectF(
                (x + g.cell_size) / dpr - w - 1, (y - image_row0 * g.pitch) / dpr + 1, w, h
            )
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(badge_bg)
            p.drawRoundedRect(rect, h / 2.5, h / 2.5)
            p.setPen(badge_fg)
            p.drawText(rect, Qt.AlignmentFlag.AlignCenter, text)
        p.end()

    def paintEvent(self, event: QPaintEvent) -> None:
        p = QPainter(self)
        palette = self._palette or style.map_palette(
            self.palette(), self.sessions.ids, self._color_of
        )
        p.fillRect(event.rect(), style.from_rgb32(palette.background))
        g = self._grid
        if self._state is None or g is None or self._plan is None:
            p.setPen(style.muted_text(self.palette()))
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "Waiting for the model…")
            p.end()
            return
        row0, row1 = self._rows_of(event.rect())
        self._ensure_image(row0, row1)
        image = self._flash_image() or self._image
        if image is not None:
            dpr = self.devicePixelRatioF()
            p.drawImage(QPoint(MARGIN, MARGIN + int(self._image_rows[0] * g.pitch / dpr)), image)
        self._paint_hover(p)
        p.end()

    def _flash_image(self) -> QImage | None:
        """The cached image with fading flashes blended in (numpy, no per-cell QPainter)."""
        g, palette, buf = self._grid, self._palette, self._image_buf
        if g is None or palette is None or buf is None or not self._anim.isActive():
            return None
        now = self.clock()
        active = np.nonzero(now - self._flash_t < FLASH_S)[0]
        if not len(active):
            return None
        row0, row1 = self._image_rows
        cells = active // g.per_cell
        inside = (cells >= row0 * g.cols) & (cells < min(row1 * g.cols, g.cells))
        active, cells = active[inside], cells[inside]
        if not len(active):
            return None
        order = np.argsort(self._flash_t[active], kind="stable")  # latest flash per cell wins
        active, cells = active[order], cells[order]
        cells, last = np.unique(cells[::-1], return_index=True)
        active = active[::-1][last]
        fade = 1.0 - (now - self._flash_t[active]) / FLASH_S
        allocated = self._flash_kind[active] == ALLOCATED
        alpha = np.where(allocated, 0.8, 0.9) * fade
        color = np.where(
            allocated, np.uint32(0xFFFFFFFF), palette.full[self._flash_owner[active]]
        ).astype(np.uint32)
        out = buf.copy()
        tiles = out.reshape(row1 - row0, g.pitch, g.cols, g.pitch)
        ri, ci = cells // g.cols - row0, cells % g.cols
        size = g.cell_size
        sub = np.ascontiguousarray(tiles[ri, :size, ci, :size]).view(np.uint8)
        a = np.rint(alpha * 256).astype(np.uint16)[:, None, None, None]
        new = color.view(np.uint8).reshape(-1, 1, 1, 4).astype(np.uint16)
        old = sub.reshape(len(cells), size, size, 4).astype(np.uint16)
        mixed = ((old * (256 - a) + new * a) >> 8).astype(np.uint8)
        tiles[ri, :size, ci, :size] = mixed.reshape(len(cells), size, size * 4).view(np.uint32)
        self._flash_buf = out  # keep the pixels alive while the QImage points at them
        h, w = out.shape
        image = QImage(out.data, w, h, w * 4, QImage.Format.Format_RGB32)
        image.setDevicePixelRatio(self.devicePixelRatioF())
        return image

    def _paint_hover(self, p: QPainter) -> None:
        g = self._grid
        if g is None or self._hover_cell < 0:
            return
        rect = self.cell_rect(self._hover_cell * g.per_cell).adjusted(-1, -1, 1, 1)
        pen = QPen(self.palette().color(self.palette().ColorRole.Text))
        pen.setWidthF(1.5)
        p.setPen(pen)
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.drawRect(rect)

    # ---- events ----------------------------------------------------------------------------

    def resizeEvent(self, event: Any) -> None:
        super().resizeEvent(event)
        if self._viewport.isEmpty():
            self._relayout()
        else:
            self._invalidate()

    def changeEvent(self, event: QEvent) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._palette = None
            self._replan()
        super().changeEvent(event)

    def event(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.ToolTip and isinstance(event, QHelpEvent):
            block = self.block_at(event.pos())
            if block < 0:
                QToolTip.hideText()
                event.ignore()
                return True
            QToolTip.showText(
                event.globalPos(), self.tooltip_text(block), self, self.cell_rect(block)
            )
            return True
        return super().event(event)

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        block = self.block_at(event.position().toPoint())
        cell = block // self._grid.per_cell if block >= 0 and self._grid else -1
        if cell != self._hover_cell:
            old = self._hover_cell
            self._hover_cell = cell
            for c in (old, cell):
                if c >= 0 and self._grid is not None:
                    self.update(self.cell_rect(c * self._grid.per_cell).adjusted(-3, -3, 3, 3))
            self.hoveredBlockChanged.emit(block)
        super().mouseMoveEvent(event)

    def leaveEvent(self, event: QEvent) -> None:
        if self._hover_cell >= 0:
            self._hover_cell = -1
            self.update()
            self.hoveredBlockChanged.emit(-1)
        super().leaveEvent(event)

    def mousePressEvent(self, event: QMouseEvent) -> None:
        if event.button() == Qt.MouseButton.LeftButton:
            self.blockClicked.emit(self.block_at(event.position().toPoint()))
        super().mousePressEvent(event)

    def wheelEvent(self, event: QWheelEvent) -> None:
        if event.modifiers() & Qt.KeyboardModifier.ControlModifier:
            dy = event.angleDelta().y()
            if dy > 0:
                self.zoom_in()
            elif dy < 0:
                self.zoom_out()
            event.accept()
            return
        event.ignore()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        key = event.key()
        if key in (Qt.Key.Key_Plus, Qt.Key.Key_Equal):
            self.zoom_in()
        elif key == Qt.Key.Key_Minus:
            self.zoom_out()
        elif key == Qt.Key.Key_0:
            self.zoom_fit()
        else:
            super().keyPressEvent(event)

    def sizeHint(self) -> QSize:
        return QSize(360, 240)


class BlockMapArea(QScrollArea):
    """Scrolls the map when zoomed in; at zoom 0 the map fits the area exactly."""

    def __init__(self, block_map: BlockMap, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("blockMapArea")
        self.setAccessibleName("KV block map area")
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.block_map = block_map
        self.setWidget(block_map)
        block_map.gridChanged.connect(self._grid_changed)

    def _grid_changed(self) -> None:
        policy = (
            Qt.ScrollBarPolicy.ScrollBarAlwaysOn
            if self.block_map.zoom > 0
            else Qt.ScrollBarPolicy.ScrollBarAlwaysOff
        )
        if self.verticalScrollBarPolicy() != policy:
            self.setVerticalScrollBarPolicy(policy)

    def viewportEvent(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.Resize:
            self.block_map.set_viewport_size(self.viewport().size())
        return super().viewportEvent(event)

    def sizeHint(self) -> QSize:
        return QSize(360, 260)
