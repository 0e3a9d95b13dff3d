"""Pool-wide counters: how full the pool is, what sharing saves, how fast the batch runs.

`pool_counters(snapshot)` is the arithmetic (pure, unit-tested); `CapacityBar` shows the pool
as one stacked bar (each chat's colour, then cached, then free) so "how full is it" needs no
reading; `CountersWidget` lays out the numbers as label/value pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QEvent, QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QPainter, QPainterPath, QPaintEvent
from PySide6.QtWidgets import QGridLayout, QLabel, QSizePolicy, QWidget

from app.monitor import style
from app.monitor.pool_state import CACHED, PoolState

MIB = 1024 * 1024


@dataclass(frozen=True)
class PoolCounters:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    used: int
    cached: int
    free: int
    shared: int
    waste_fraction: float
    saved_bytes: int
    hit_rate: float
    hits: int
    queries: int
    batch: int
    step_ms: float
    tokens_per_s: float
    preemptions: int
    #: The disk tier under the pool (docs/ARCHITECTURE.md §3.14): None when it is off.
    disk: Any = None
    #: speculative decoding (engine Counters): the share of drafts accepted, and the
    #: tokens they gained (accepted drafts), 0 when none was verified
    draft_acceptance: float = 0.0
    drafts_gained: int = 0
    drafts_verified: int = 0

    def mib(self, blocks: int) -> float:
        return blocks * self.bytes_per_block / MIB


def pool_counters(state: PoolState) -> PoolCounters:
    """The panel's numbers from one snapshot's PoolState (numpy: cheap at 16k blocks).

    Sharing saves (refcount - 1) blocks for every block held by several sequences.
    """
    c = state.snapshot.counters
    used_mask = state.used_mask()
    used = int(used_mask.sum())
    cached = int((state.category == CACHED).sum())
    held_slots = int(state.fill[used_mask].sum())
    return PoolCounters(
        num_blocks=state.num_blocks,
        block_size=state.block_size,
        bytes_per_block=state.bytes_per_block,
        used=used,
        cached=cached,
        free=state.num_blocks - used - cached,
        shared=int((state.refcount > 1).sum()),
        waste_fraction=1.0 - held_slots / (used * state.block_size) if used else 0.0,
        saved_bytes=state.shared_savings_bytes(),
        hit_rate=c.prefix_cache_hit_rate,
        hits=c.prefix_cache_hits,
        queries=c.prefix_cache_queries,
        batch=c.batch_size,
        step_ms=c.step_time_ms,
        tokens_per_s=c.tokens_per_s,
        preemptions=c.preemptions,
        disk=getattr(state.snapshot, "disk", None),
        draft_acceptance=c.draft_acceptance,
        drafts_gained=c.accepted_draft_tokens,
        drafts_verified=c.draft_tokens,
    )


def fmt_mib(value: float) -> str:
    if value >= 1024:
        return f"{value / 1024:.2f} GiB"
    if value >= 100:
        return f"{value:.0f} MiB"
    return f"{value:.1f} MiB"


class CapacityBar(QWidget):
    """The pool as one bar: blocks held (by chat colour), cached (hatched), free (empty)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("capacityBar")
        self.setAccessibleName("Pool fill")
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent, True)  # fills its own rect
        self._segments: list[tuple[QColor, int]] = []
        self._cached = 0
        self._total = 0

    def set_segments(self, segments: list[tuple[QColor, int]], cached: int, total: int) -> None:
        """`segments`: (chat colour, used blocks whose first owner is that chat)."""
        if (segments, cached, total) == (self._segments, self._cached, self._total):
            return
        self._segments, self._cached, self._total = segments, cached, total
        used = sum(n for _, n in segments)
        self.setAccessibleDescription(
            f"{used} of {total} blocks in use, {cached} cached, {total - used - cached} free"
        )
        self.update()

    def sizeHint(self) -> QSize:
        return QSize(300, 10)

    def minimumSizeHint(self) -> QSize:
        return QSize(60, 10)

    def paintEvent(self, event: QPaintEvent) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = self.palette()
        bg = style.surface(pal)
        text = pal.color(pal.ColorRole.Text)
        empty = style.mix(bg, text, 0.075 if style.is_dark(pal) else 0.065)
        p.fillRect(self.rect(), bg)
        rect = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        radius = rect.height() / 2
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(empty)
        p.drawRoundedRect(rect, radius, radius)
        if self._total > 0:
            p.save()
            clip = QRectF(rect)
            path = QPainterPath()
            path.addRoundedRect(clip, radius, radius)
            p.setClipPath(path)
            x = rect.left()
            scale = rect.width() / self._total
            for color, n in self._segments:
                w = n * scale
                p.fillRect(QRectF(x, rect.top(), w, rect.height()), color)
                x += w
            if self._cached:
                w = self._cached * scale
                cached = style.mix(text, bg, 0.6)
                area = QRectF(x, rect.top(), w, rect.height())
                p.fillRect(area, style.mix(text, bg, 0.78))
                p.fillRect(area, QBrush(cached, Qt.BrushStyle.BDiagPattern))
            p.restore()
        p.end()


WIDEST = {  # the widest text each value shows (sizes the fixed-width value labels)
    "used": "16,384 · 11.25 GiB",
    "cached": "16,384 · 11.25 GiB",
    "free": "16,384 · 11.25 GiB",
    "waste": "100.0 %",
    "saved": "999.9 MiB",
    "hits": "100 % of 99,999",
    "batch": "999",
    "step": "9,999 ms",
    "rate": "999.9 tok/s",
    "preemptions": "99,999",
    "disk": "999.9 GiB · 99,999",
    "disk_hits": "99,999 · 9,999 reads",
    "drafts": "100 % · +9,999,999",
}


class CountersWidget(QWidget):
    """Label/value pairs in two columns, updated from PoolCounters."""

    FIELDS = (
        ("used", "Used", "Blocks held by at least one sequence"),
        ("cached", "Cached", "Prefix blocks nobody holds: reusable by a matching prompt, "
         "evicted (LRU) only when no free block is left"),
        ("free", "Free", "Blocks holding nothing"),
        ("waste", "Waste", "Allocated slots not holding a token (only the last block of each "
         "sequence can be partly empty)"),
        ("saved", "Sharing saves", "Memory that shared blocks would take if every sequence "
         "had its own copy: sum of (refcount − 1) × block size"),
        ("hits", "Prefix hits", "Prompt blocks found in the prefix cache / looked up"),
        ("batch", "Batch", "Sequences in the last engine step"),
        ("step", "Step time", "Time of one engine step (forward pass + scheduling)"),
        ("rate", "Speed", "Tokens generated per second, all chats together"),
        ("preemptions", "Preemptions", "Sequences evicted to make room (recomputed later)"),
        ("disk", "Disk tier", "Chats asleep on disk: the size of the disk cache and its "
         "blocks (every model's); off when the disk cache budget is 0"),
        ("disk_hits", "Read back", "Blocks read back from disk instead of recomputed, and "
         "the prompts looked up there"),
        ("drafts", "Drafts", "Speculative decoding: the share of drafted tokens accepted, "
         "and the tokens they gained"),
    )

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("monitorCounters")
        self.setAccessibleName("KV pool counters")
        self.grid = QGridLayout(self)
        self.grid.setContentsMargins(0, 0, 0, 0)
        self.grid.setHorizontalSpacing(8)
        self.grid.setVerticalSpacing(3)
        self.values: dict[str, QLabel] = {}
        self._names: dict[str, QLabel] = {}
        for key, label, tip in self.FIELDS:
            name = QLabel(label)
            name.setObjectName("counterLabel")
            name.setToolTip(tip)
            value = QLabel("–")
            value.setObjectName("counterValue")
            value.setToolTip(tip)
            value.setAccessibleName(f"{label}: –")  # read with its value, as it is shown
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            self._names[key] = name
            self.values[key] = value
        self.columns = 0
        self._fix_value_sizes()
        self._arrange(2)

    def _arrange(self, columns: int) -> None:
        """Two label/value columns when the dock is wide enough, else one (so the dock can
        be narrow without clipping the values)."""
        if columns == self.columns:
            return
        self.columns = columns
        for i in reversed(range(self.grid.count())):
            self.grid.takeAt(i)
        rows = (len(self.FIELDS) + columns - 1) // columns
        for i, (key, _label, _tip) in enumerate(self.FIELDS):
            row, col = i % rows, (i // rows) * 2
            self.grid.addWidget(self._names[key], row, col)
            self.grid.addWidget(self.values[key], row, col + 1)
        for c in range(4):
            self.grid.setColumnStretch(c, 1 if c in (1, 3) and c < 2 * columns else 0)

    def _width_for(self, columns: int) -> int:
        """The width `columns` label/value pairs need."""
        keys = [k for k, _, _ in self.FIELDS]
        rows = (len(keys) + columns - 1) // columns
        spacing = self.grid.horizontalSpacing()
        total = 0
        for c in range(columns):
            group = keys[c * rows : (c + 1) * rows]
            names = max(self._names[k].sizeHint().width() for k in group)
            values = max(self.values[k].width() for k in group)
            total += names + spacing + values
        return total + (columns - 1) * spacing

    def _height_for(self, columns: int) -> int:
        rows = (len(self.FIELDS) + columns - 1) // columns
        return rows * (self.values["used"].height() + self.grid.verticalSpacing())

    def minimumSizeHint(self) -> QSize:
        """One column's width (the dock may be narrow), the current arrangement's height."""
        return QSize(self._width_for(1), self._height_for(max(1, self.columns)))

    def resizeEvent(self, event: Any) -> None:
        columns = 2 if event.size().width() >= self._width_for(2) else 1
        if columns != self.columns:
            self._arrange(columns)
            self.updateGeometry()  # the height it needs changed
        super().resizeEvent(event)

    def _fix_value_sizes(self) -> None:
        """Fixed-size value labels: a label whose size is fixed does not invalidate the
        layout when its text changes, so a 10 Hz refresh repaints just the labels."""
        fm = self.values["used"].fontMetrics()  # the labels' own (possibly smaller) font
        width = max(fm.horizontalAdvance(WIDEST[k]) for k, _, _ in self.FIELDS) + 2
        for k, _, _ in self.FIELDS:
            self.values[k].setFixedSize(width, fm.height() + 2)

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() == QEvent.Type.FontChange:
            self.refit()

    def refit(self) -> None:
        """Re-measure after the labels' fonts changed (the monitor shrinks them)."""
        self._fix_value_sizes()
        self.columns = 0  # re-arrange for the current width
        self._arrange(2 if self.width() >= self._width_for(2) else 1)
        self.updateGeometry()

    def set_counters(self, c: PoolCounters) -> None:
        texts = {
            "used": f"{c.used:,} · {fmt_mib(c.mib(c.used))}",
            "cached": f"{c.cached:,} · {fmt_mib(c.mib(c.cached))}",
            "free": f"{c.free:,} · {fmt_mib(c.mib(c.free))}",
            "waste": f"{c.waste_fraction * 100:.1f} %",
            "saved": fmt_mib(c.saved_bytes / MIB),
            "hits": f"{c.hit_rate * 100:.0f} % of {c.queries:,}"
            if c.queries
            else "–",
            "batch": f"{c.batch}",
            "step": f"{c.step_ms:,.0f} ms" if c.step_ms else "–",
            "rate": f"{c.tokens_per_s:.1f} tok/s",
            "preemptions": f"{c.preemptions:,}",
            "disk": (f"{fmt_mib(c.disk.bytes / MIB)} · {c.disk.files:,}"
                     + (" ⚠" if c.disk.error else "")) if c.disk is not None else "off",
            "disk_hits": f"{c.disk.hits:,} · {c.disk.reads:,} reads"
            if c.disk is not None else "–",
            "drafts": f"{c.draft_acceptance * 100:.0f} % · +{c.drafts_gained:,}"
            if c.drafts_verified
            else "–",
        }
        for key, text in texts.items():
            label = self.values[key]
            if label.text() != text:
                label.setText(text)
                # a screen reader reads a named label by its name alone: name it with the
                # value ("Used: 12 · 1.5 MiB"), not just "Used"
                label.setAccessibleName(f"{self._names[key].text()}: {text}")

    def value(self, key: str) -> str:
        return self.values[key].text()
