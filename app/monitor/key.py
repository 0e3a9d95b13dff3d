"""The map key: one swatch per kind of cell, drawn by the same rasteriser as the map.

A newcomer reads the map from this strip, so its swatches must look exactly like the cells:
they are rasterised with the map's own code and palette, not imitated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PySide6.QtCore import QPoint, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QImage, QPainter, QPaintEvent
from PySide6.QtWidgets import QSizePolicy, QWidget

from app.monitor import style
from app.monitor.cell_colors import session_tables
from app.monitor.grid import Grid
from app.monitor.raster import CellPaint, rasterize
from app.ui import colors

SWATCH = 13  # logical px


@dataclass(frozen=True)
class KeyItem:
    label: str
    tip: str
    kind: str  # held | partial | shared | cached | free


ITEMS = (
    KeyItem("held", "A block held by one sequence, in its chat's colour", "held"),
    KeyItem(
        "partly filled",
        "The solid part holds tokens; the pale part is allocated but still empty (waste)",
        "partial",
    ),
    KeyItem(
        "shared",
        "Held by several sequences (refcount > 1, shown in large cells); split diagonally "
        "when two chats share it",
        "shared",
    ),
    KeyItem(
        "cached prefix",
        "Held by nobody but kept, hashed, for a later prompt with the same prefix; evicted "
        "only when no free block is left",
        "cached",
    ),
    KeyItem("free", "Holds nothing", "free"),
)


def _swatch_paint(kind: str, size: int, full: int, second: int, pale: int, cached: int,
                  hatch: int, empty: int) -> CellPaint:
    h1 = {"held": size, "partial": max(1, size * 6 // 16), "shared": size, "cached": size}
    one = {
        "c1": np.array([cached if kind == "cached" else full], dtype=np.uint32),
        "c2": np.array([pale], dtype=np.uint32),
        "c3": np.array([empty], dtype=np.uint32),
        "h1": np.array([h1.get(kind, 0)], dtype=np.int32),
        "h2": np.array([size if kind in ("held", "partial", "shared", "cached") else 0],
                       dtype=np.int32),
        "a1": np.array([second], dtype=np.uint32),
        "a2": np.array([pale], dtype=np.uint32),
        "split": np.array([kind == "shared"]),
        "hatch": np.array([1 if kind == "cached" else 0], dtype=np.int8),
        "hatch_color": np.array([hatch], dtype=np.uint32),
        "mark": np.array([kind == "shared"]),
    }
    return CellPaint(**one)


class MapKey(QWidget):
    """A wrapping row of swatches with short labels (each with a tooltip)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("mapKey")
        self.setAccessibleName("Block map key")
        self.setAccessibleDescription(
            "; ".join(f"{item.label}: {item.tip}" for item in ITEMS)
            + "; blocks just allocated or freed flash briefly."
        )
        self.setToolTip(
            "<br>".join(f"<b>{item.label}</b>: {item.tip}" for item in ITEMS)
            + "<br><b>flash</b>: a block just allocated (white) or freed (its chat's colour)"
        )
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self._swatch_key: tuple[int, float] | None = None
        self._swatch_images: dict[str, QImage] = {}

    def _font(self) -> QFont:
        font = QFont(self.font())
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.85))
        return font

    def _layout(self, width: int) -> list[tuple[KeyItem, QPoint]]:
        fm = QFontMetrics(self._font())
        line = max(SWATCH, fm.height()) + 4
        x, y, out = 0, 0, []
        for item in ITEMS:
            w = SWATCH + 5 + fm.horizontalAdvance(item.label) + 12
            if x and x + w > width:
                x, y = 0, y + line
            out.append((item, QPoint(x, y)))
            x += w
        return out

    def hasHeightForWidth(self) -> bool:
        return True

    def heightForWidth(self, width: int) -> int:
        line = max(SWATCH, QFontMetrics(self._font()).height()) + 4
        last = self._layout(width)[-1][1].y()
        return last + line

    def sizeHint(self) -> QSize:
        return QSize(360, self.heightForWidth(360))

    def minimumSizeHint(self) -> QSize:
        """Never shorter than its rows at its width: in a narrow monitor (four panes at
        1280 px) the panel's layout squeezed it to one row and the rest of the key vanished."""
        return QSize(0, self.heightForWidth(self.width() if self.width() > 1 else 360))

    def resizeEvent(self, event: Any) -> None:
        super().resizeEvent(event)
        if event.oldSize().width() != event.size().width():
            self.updateGeometry()  # rows may have wrapped or joined

    def _swatches(self) -> dict[str, QImage]:
        """The swatch images, rasterised once per palette and pixel ratio."""
        pal = self.palette()
        dpr = self.devicePixelRatioF()
        key = (pal.cacheKey(), dpr)
        if key == self._swatch_key:
            return self._swatch_images
        mp = style.map_palette(pal, [])
        size = round(SWATCH * dpr)
        grid = Grid(num_blocks=1, per_cell=1, cols=1, pitch=size, gap=0)
        full = style.to_rgb32(QColor(colors.PALETTE[0]))
        second = style.to_rgb32(QColor(colors.PALETTE[1]))
        _, pale, cached, hatch = session_tables(
            [full], mp.background, mp.empty, mp.neutral, mp.dark
        )
        images = {}
        for item in ITEMS:
            paint = _swatch_paint(item.kind, size, full, second, int(pale[0]), int(cached[0]),
                                  int(hatch[0]), mp.empty)
            buf = rasterize(paint, grid, 0, 1, mp.background, mp.mark,
                            stripe=max(2, round(2 * dpr)))
            image = QImage(buf.data, size, size, size * 4, QImage.Format.Format_RGB32).copy()
            image.setDevicePixelRatio(dpr)
            images[item.kind] = image
        self._swatch_key, self._swatch_images = key, images
        return images

    def paintEvent(self, event: QPaintEvent) -> None:
        pal = self.palette()
        images = self._swatches()
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.TextAntialiasing)
        p.setFont(self._font())
        fm = p.fontMetrics()
        line = max(SWATCH, fm.height()) + 4
        p.setPen(style.muted_text(pal))
        for item, pos in self._layout(self.width()):
            top = pos.y() + (line - SWATCH) / 2
            p.drawImage(QPoint(pos.x(), int(top)), images[item.kind])
            p.drawText(
                QRectF(pos.x() + SWATCH + 5, pos.y(), 400, line),
                Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                item.label,
            )
        p.end()
