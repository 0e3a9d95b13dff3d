"""The last 60 seconds of the pool: used, cached and shared blocks, and tokens/s.

`Samples` is a fixed-size ring buffer of numpy arrays (no allocation per sample); the chart
is a small custom-painted widget: blocks on the left scale (used as a filled area, cached
stacked above it and hatched, shared as a line), tokens/s on the right scale as a line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import (
    QBrush,
    QColor,
    QFont,
    QFontMetrics,
    QPainter,
    QPaintEvent,
    QPen,
    QPixmap,
    QPolygonF,
)
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from app.monitor import style

WINDOW_S = 60.0
CAPACITY = 2048  # > 60 s at 10 Hz, with room for faster sampling
BUCKET_PX = 3.0  # one plotted point per 3 px of chart width

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


def decimate(
    xs: np.ndarray, series: dict[str, np.ndarray], px: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """At most one point per `px` pixels, keeping each bucket's peak (stroking hundreds of
    jagged points costs tens of milliseconds; a peak never disappears by decimating)."""
    if len(xs) < 2:
        return xs, series
    bucket = np.floor(xs / px).astype(np.int64)
    starts = np.nonzero(np.diff(bucket, prepend=bucket[0] - 1))[0]
    if len(starts) == len(xs):
        return xs, series
    out = {k: np.maximum.reduceat(v, starts) for k, v in series.items() if k != "t"}
    out["t"] = series["t"][starts]
    return xs[starts], out


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
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent, True)  # fills its own rect
        self.samples = Samples()
        self.num_blocks = 0
        self.clock: Callable[[], float] = time.monotonic
        self._chrome_key: tuple | None = None
        self._chrome_pixmap: QPixmap | None = None
        self.setMouseTracking(True)  # the hover readout
        self.hover_text = ""

    def readout_at(self, x: float) -> str:
        """The sample under x (widget coordinates), in words: its age and values."""
        now = self.clock()
        s = self.samples.series(since=now - WINDOW_S)
        if not len(s["t"]):
            return ""
        rate_max = nice_ceiling(float(s["rate"].max()))
        plot = self._plot_rect(f"{self.blocks_scale(s):,} blk", f"{rate_max:g} tok/s")
        if plot.width() <= 0 or not plot.left() - 2 <= x <= plot.right() + 2:
            return ""
        age = (plot.right() - x) / plot.width() * WINDOW_S
        i = int(np.argmin(np.abs((now - s["t"]) - age)))
        ago = now - s["t"][i]
        when = "now" if ago < 0.5 else f"{ago:.0f} s ago"
        return (
            f"{when}: {int(s['used'][i]):,} blocks used · {int(s['cached'][i]):,} cached · "
            f"{int(s['shared'][i]):,} shared · {s['rate'][i]:.1f} tok/s"
        )

    def mouseMoveEvent(self, event: Any) -> None:
        text = self.readout_at(event.position().x())
        self.hover_text = text
        if text:
            QToolTip.showText(event.globalPosition().toPoint(), text, self, self.rect(), 60_000)
        else:
            QToolTip.hideText()
        super().mouseMoveEvent(event)

    def leaveEvent(self, event: Any) -> None:
        self.hover_text = ""
        QToolTip.hideText()
        super().leaveEvent(event)

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

    def _font(self) -> QFont:
        font = QFont(self.font())
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.82))
        return font

    def _plot_rect(self, left_label: str, right_label: str) -> QRectF:
        fm = QFontMetrics(self._font())
        pad_l = fm.horizontalAdvance(left_label) + 6
        pad_r = fm.horizontalAdvance(right_label) + 6
        plot = QRectF(pad_l, fm.height() + 4, self.width() - pad_l - pad_r, 0)
        plot.setBottom(self.height() - fm.height() - 4)
        return plot

    def _chrome(self, left_label: str, right_label: str) -> QPixmap:
        """Background, grid, axis labels and key: text is the slow part of painting, and it
        only changes with the size, the theme or an axis maximum, so it is cached."""
        pal = self.palette()
        dpr = self.devicePixelRatioF()
        key = (self.size(), dpr, pal.cacheKey(), left_label, right_label)
        if key == self._chrome_key and self._chrome_pixmap is not None:
            return self._chrome_pixmap
        pixmap = QPixmap(round(self.width() * dpr), round(self.height() * dpr))
        pixmap.setDevicePixelRatio(dpr)
        bg = style.surface(pal)
        text = pal.color(pal.ColorRole.Text)
        muted = style.muted_text(pal)
        pixmap.fill(bg)
        p = QPainter(pixmap)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.setFont(self._font())
        fm = p.fontMetrics()
        plot = self._plot_rect(left_label, right_label)
        if plot.width() >= 20 and plot.height() >= 12:
            p.setPen(QPen(style.mix(bg, text, 0.12), 1.0))
            for frac in (0.0, 0.5, 1.0):
                y = plot.bottom() - frac * plot.height()
                p.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
            p.setPen(muted)
            right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
            left = Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter
            h = fm.height()
            p.drawText(QRectF(0, plot.top() - h / 2, plot.left() - 4, h), right, left_label)
            p.drawText(QRectF(0, plot.bottom() - h / 2, plot.left() - 4, h), right, "0")
            p.drawText(QRectF(plot.right() + 4, plot.top() - h / 2, 200, h), left, right_label)
            p.drawText(
                QRectF(plot.left(), plot.bottom() + 2, 60, h), Qt.AlignmentFlag.AlignLeft, "−60 s"
            )
            p.drawText(
                QRectF(plot.right() - 60, plot.bottom() + 2, 60, h),
                Qt.AlignmentFlag.AlignRight,
                "now",
            )
            self._paint_key(p, plot, h, text, muted)
        p.end()
        self._chrome_key, self._chrome_pixmap = key, pixmap
        return pixmap

    def paintEvent(self, event: QPaintEvent) -> None:
        now = self.clock()
        s = self.samples.series(since=now - WINDOW_S)
        rate_max = nice_ceiling(float(s["rate"].max()) if len(s["rate"]) else 0.0)
        blocks_max = self.blocks_scale(s)
        left_label, right_label = f"{blocks_max:,} blk", f"{rate_max:g} tok/s"
        p = QPainter(self)
        p.drawPixmap(0, 0, self._chrome(left_label, right_label))
        plot = self._plot_rect(left_label, right_label)
        if len(s["t"]) and plot.width() >= 20 and plot.height() >= 12:
            pal = self.palette()
            xs = plot.right() - (now - s["t"]) / WINDOW_S * plot.width()
            xs, s = decimate(xs, s, BUCKET_PX)
            self._paint_series(
                p,
                plot,
                xs,
                s,
                blocks_max,
                rate_max,
                pal.color(pal.ColorRole.Text),
                style.surface(pal),
            )
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

    def _paint_series(
        self,
        p: QPainter,
        plot: QRectF,
        xs: np.ndarray,
        s: dict[str, np.ndarray],
        blocks_max: float,
        rate_max: float,
        text: QColor,
        bg: QColor,
    ) -> None:
        """Areas without antialiasing, 1 px antialiased lines: Qt's fast paths (a 1.5 px
        antialiased stroke of a jagged 150-point line costs ~8 ms, a 1 px one ~0.2 ms)."""

        def y_blocks(v: np.ndarray) -> np.ndarray:
            return plot.bottom() - np.clip(v / blocks_max, 0, 1) * plot.height()

        used_y = y_blocks(s["used"])
        top_y = y_blocks(s["used"] + s["cached"])
        base = np.full(len(xs), plot.bottom())
        p.setRenderHint(QPainter.RenderHint.Antialiasing, False)
        p.setPen(Qt.PenStyle.NoPen)
        cached = band(xs, used_y, top_y)
        p.setBrush(style.mix(text, bg, 0.82))
        p.drawPolygon(cached)
        p.setBrush(QBrush(style.mix(text, bg, 0.6), Qt.BrushStyle.BDiagPattern))
        p.drawPolygon(cached)
        used_color = self._used_color(text)
        fill = QColor(used_color)
        fill.setAlphaF(0.35)
        p.setBrush(fill)
        p.drawPolygon(band(xs, base, used_y))
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        rate_y = plot.bottom() - np.clip(s["rate"] / rate_max, 0, 1) * plot.height()
        for ys, color in (
            (used_y, used_color),
            (y_blocks(s["shared"]), SHARED_COLOR),
            (rate_y, RATE_COLOR),
        ):
            if len(xs) >= 2:
                p.setPen(QPen(color, 1.0))
                p.drawPolyline(polyline(xs, ys))


def polyline(xs: np.ndarray, ys: np.ndarray) -> QPolygonF:
    return QPolygonF([QPointF(x, y) for x, y in zip(xs.tolist(), ys.tolist(), strict=True)])


def band(xs: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> QPolygonF:
    """The polygon between two lines (upper left to right, then lower right to left)."""
    return polyline(np.concatenate([xs, xs[::-1]]), np.concatenate([upper, lower[::-1]]))
