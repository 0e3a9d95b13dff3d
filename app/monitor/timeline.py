"""The last 60 seconds of the pool: used, cached and shared blocks, and tokens/s.

`Samples` is a fixed-size ring buffer of numpy arrays (no allocation per sample); the chart
is a small custom-painted widget: blocks on the left scale (used as a filled area, cached
stacked above it and hatched, shared as a line), tokens/s on the right scale as a line.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPainterPath, QPaintEvent, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from app.monitor import style

WINDOW_S = 60.0
CAPACITY = 2048  # > 60 s at 10 Hz, with room for faster sampling

SHARED_COLOR = QColor("#F2A93B")
RATE_COLOR = QColor("#34C759")


class Samples:
    """Ring buffer of (time, used, cached, shared, tokens/s)."""

    FIELDS = ("t", "used", "cached", "shared", "rate")

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._data = np.zeros((len(self.FIELDS), capacity), dtype=np.float64)
        self._next = 0
        self._count = 0

    def add(self, t: float, used: int, cached: int, shared: int, rate: float) -> None:
        self._data[:, self._next] = (t, used, cached, shared, rate)
        self._next = (self._next + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)

    def __len__(self) -> int:
        return self._count

    def series(self, since: float | None = None) -> dict[str, np.ndarray]:
        """Samples in time order (only those at or after `since`)."""
        if self._count < self.capacity:
            data = self._data[:, : self._count]
        else:
            data = np.roll(self._data, -self._next, axis=1)
        if since is not None and data.shape[1]:
            data = data[:, data[0] >= since]
        return {name: data[i] for i, name in enumerate(self.FIELDS)}

    def clear(self) -> None:
        self._next = self._count = 0


def nice_ceiling(value: float) -> float:
    """The next 1/2/5 x 10^k at or above value (axis maxima that read well)."""
    if value <= 0:
        return 1.0
    exp = 10 ** np.floor(np.log10(value))
    for m in (1, 2, 5, 10):
        if value <= m * exp:
            return float(m * exp)
    return float(10 * exp)


class TimelineWidget(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("monitorTimeline")
        self.setAccessibleName("KV pool timeline, last 60 seconds")
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.samples = Samples()
        self.num_blocks = 0
        self.clock: Callable[[], float] = time.monotonic

    def add(self, used: int, cached: int, shared: int, rate: float, num_blocks: int) -> None:
        if num_blocks != self.num_blocks:
            self.samples.clear()  # a new pool (engine restarted): old samples mean nothing
            self.num_blocks = num_blocks
        self.samples.add(self.clock(), used, cached, shared, rate)
        self.update()

    def blocks_scale(self, s: dict[str, np.ndarray]) -> int:
        """The blocks axis: the whole pool, or less when the last minute never came close
        (a 1,000-block pool holding 20 blocks would otherwise draw flat lines)."""
        pool = max(1, self.num_blocks)
        if not len(s["used"]):
            return pool
        peak = float(np.max(np.maximum(s["used"] + s["cached"], s["shared"])))
        return int(min(pool, nice_ceiling(max(8.0, peak * 1.15))))

    def sizeHint(self) -> QSize:
        return QSize(360, 110)

    def minimumSizeHint(self) -> QSize:
        return QSize(160, 70)

    def paintEvent(self, event: QPaintEvent) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = self.palette()
        bg = style.surface(pal)
        text = pal.color(pal.ColorRole.Text)
        muted = style.muted_text(pal)
        p.fillRect(self.rect(), bg)
        font = QFont(self.font())
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.82))
        p.setFont(font)
        fm = p.fontMetrics()
        now = self.clock()
        s = self.samples.series(since=now - WINDOW_S)
        rate_max = nice_ceiling(float(s["rate"].max()) if len(s["rate"]) else 0.0)
        blocks_max = self.blocks_scale(s)
        left_label = f"{blocks_max:,} blk"
        right_label = f"{rate_max:g} tok/s"
        pad_l = fm.horizontalAdvance(left_label) + 6
        pad_r = fm.horizontalAdvance(right_label) + 6
        plot = QRectF(pad_l, fm.height() + 4, self.width() - pad_l - pad_r, 0)
        plot.setBottom(self.height() - fm.height() - 4)
        if plot.width() < 20 or plot.height() < 12:
            p.end()
            return
        grid_pen = QPen(style.mix(bg, text, 0.12))
        grid_pen.setWidthF(1.0)
        p.setPen(grid_pen)
        for frac in (0.0, 0.5, 1.0):
            y = plot.bottom() - frac * plot.height()
            p.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
        p.setPen(muted)
        p.drawText(QRectF(0, plot.top() - fm.height() / 2, pad_l - 4, fm.height()),
                   Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, left_label)
        p.drawText(QRectF(0, plot.bottom() - fm.height() / 2, pad_l - 4, fm.height()),
                   Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, "0")
        p.drawText(QRectF(plot.right() + 4, plot.top() - fm.height() / 2, pad_r, fm.height()),
                   Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, right_label)
        bottom_y = plot.bottom() + 2
        p.drawText(QRectF(plot.left(), bottom_y, 60, fm.height()),
                   Qt.AlignmentFlag.AlignLeft, "−60 s")
        p.drawText(QRectF(plot.right() - 60, bottom_y, 60, fm.height()),
                   Qt.AlignmentFlag.AlignRight, "now")
        self._paint_key(p, plot, fm.height(), text, muted)
        if len(s["t"]) >= 1:
            xs = plot.right() - (now - s["t"]) / WINDOW_S * plot.width()
            self._paint_series(p, plot, xs, s, blocks_max, rate_max, text, bg)
        p.end()

    def _paint_key(self, p: QPainter, plot: QRectF, h: float, text: QColor, muted: QColor) -> None:
        used = self._used_color(text)
        items = (
            (used, "used"),
            (style.mix(text, style.surface(self.palette()), 0.7), "cached"),
            (SHARED_COLOR, "shared"),
            (RATE_COLOR, "tok/s"),
        )
        x = plot.left()
        fm = p.fontMetrics()
        for color, label in items:
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(color)
            p.drawRoundedRect(QRectF(x, 2 + h / 2 - 3, 8, 6), 2, 2)
            x += 11
            p.setPen(muted)
            p.drawText(QPointF(x, 2 + fm.ascent()), label)
            x += fm.horizontalAdvance(label) + 10

    def _used_color(self, text: QColor) -> QColor:
        """Neutral on purpose: chat colours mean chats everywhere else in the panel."""
        return style.mix(text, style.surface(self.palette()), 0.35)

    def _paint_series(self, p, plot, xs, s, blocks_max, rate_max, text, bg) -> None:
        def y_blocks(v: np.ndarray) -> np.ndarray:
            return plot.bottom() - np.clip(v / blocks_max, 0, 1) * plot.height()

        used_y = y_blocks(s["used"])
        top_y = y_blocks(s["used"] + s["cached"])
        base = plot.bottom()
        xs_l = xs.tolist()
        # cached: between used and used + cached
        path = QPainterPath()
        path.moveTo(xs_l[0], float(used_y[0]))
        for x, y in zip(xs_l, top_y.tolist(), strict=True):
            path.lineTo(x, y)
        for x, y in zip(reversed(xs_l), reversed(used_y.tolist()), strict=True):
            path.lineTo(x, y)
        path.closeSubpath()
        cached_fill = style.mix(text, bg, 0.82)
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(cached_fill)
        p.drawPath(path)
        p.setBrush(QBrush(style.mix(text, bg, 0.6), Qt.BrushStyle.BDiagPattern))
        p.drawPath(path)
        # used: area from the baseline
        used_color = self._used_color(text)
        fill = QColor(used_color)
        fill.setAlphaF(0.35)
        area = QPainterPath()
        area.moveTo(xs_l[0], base)
        for x, y in zip(xs_l, used_y.tolist(), strict=True):
            area.lineTo(x, y)
        area.lineTo(xs_l[-1], base)
        area.closeSubpath()
        p.setBrush(fill)
        p.drawPath(area)
        p.setBrush(Qt.BrushStyle.NoBrush)
        self._line(p, xs_l, used_y.tolist(), used_color, 1.5)
        self._line(p, xs_l, y_blocks(s["shared"]).tolist(), SHARED_COLOR, 1.5)
        rate_y = plot.bottom() - np.clip(s["rate"] / rate_max, 0, 1) * plot.height()
        self._line(p, xs_l, rate_y.tolist(), RATE_COLOR, 1.5)

    @staticmethod
    def _line(p: QPainter, xs: list[float], ys: list[float], color: QColor, width: float) -> None:
        if len(xs) < 2:
            return
        path = QPainterPath()
        path.moveTo(xs[0], ys[0])
        for x, y in zip(xs[1:], ys[1:], strict=True):
            path.lineTo(x, y)
        pen = QPen(color)
        pen.setWidthF(width)
        p.setPen(pen)
        p.drawPath(path)
