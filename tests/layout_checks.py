"""Measured layout properties, shared by the offscreen layout tests and the walk-through:
what a pane header cuts, and where every widget of a window sits."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QRect, Qt
from PySide6.QtWidgets import QWidget


def header_cuts(pane: Any) -> list[str]:
    """Texts a pane header shows cut: the title (every word of the chat's title must be on
    the label, none ending in "…") and the model menu (its label wrapped into the combo's
    height, no word wider than the room for it). Independent of the pane's own wrapping."""
    cuts = []
    title = pane.session.title
    shown = pane.title_label.text()
    if shown.split() != title.split() or "…" in shown:
        cuts.append(f"title {shown!r} of {title!r}")
    fm = pane.title_label.fontMetrics()
    for line in shown.splitlines():
        if fm.horizontalAdvance(line) > pane.title_label.width():
            cuts.append(f"title line {line!r} wider than {pane.title_label.width()} px")
    if len(shown.splitlines()) * fm.lineSpacing() > pane.title_label.height():
        cuts.append(f"title {shown!r} taller than its label ({pane.title_label.height()} px)")
    combo = pane.model_selector
    text = combo.display_text()  # as painted (hyphens do not break)
    room = combo._text_rect(combo.width(), combo.height())
    cfm = combo.fontMetrics()
    if any(cfm.horizontalAdvance(w) > room.width() for w in text.split()):
        cuts.append(f"model {text!r}: a word is wider than {room.width()} px")
    need = cfm.boundingRect(QRect(0, 0, max(1, room.width()), 10_000),
                            int(Qt.TextFlag.TextWordWrap), text)
    if need.height() > room.height() + 1:
        cuts.append(f"model {text!r} needs {need.height()} px, has {room.height()}")
    return cuts


def geometries(window: QWidget, exclude: tuple[QWidget, ...] = ()) -> dict[str, tuple]:
    """Every visible widget's rectangle in window coordinates, keyed by its place in the tree
    (class names and sibling index), so two calls on one window can be compared."""
    out: dict[str, tuple] = {}

    def walk(w: QWidget, key: str) -> None:
        for i, child in enumerate(c for c in w.children() if isinstance(c, QWidget)):
            if not child.isVisible() or child.isWindow() or child in exclude:
                continue
            k = f"{key}/{child.metaObject().className()}[{i}]{child.objectName()}"
            top = child.mapTo(window, child.rect().topLeft())
            out[k] = (top.x(), top.y(), child.width(), child.height())
            walk(child, k)

    walk(window, "")
    return out


def settled_geometries(qtbot: Any, window: QWidget,
                       exclude: tuple[QWidget, ...] = ()) -> dict[str, tuple]:
    """`geometries` once two looks in a row, with events processed between them, agree
    (layouts settle over several event-loop turns)."""
    seen: dict[str, Any] = {"last": None}

    def stable() -> bool:
        now = geometries(window, exclude)
        same, seen["last"] = now == seen["last"], now
        return same

    qtbot.waitUntil(stable, timeout=5000)
    return seen["last"]
