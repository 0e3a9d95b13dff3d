"""Measured properties of the window, shared by the offscreen tests and the walk-through:
what a pane header cuts, where every widget sits, what a screen reader reaches."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QRect, Qt
from PySide6.QtGui import QAccessible
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
    """`geometries` once three looks in a row, with events processed between them, agree
    (layouts settle over several event-loop turns: a dock resized for room lands a turn
    after the resize that asked for it)."""
    seen: dict[str, Any] = {"last": None, "same": 0}

    def stable() -> bool:
        now = geometries(window, exclude)
        seen["same"] = seen["same"] + 1 if now == seen["last"] else 0
        seen["last"] = now
        return seen["same"] >= 2

    qtbot.waitUntil(stable, timeout=5000)
    return seen["last"]


_R = QAccessible.Role
# roles a user acts on: each must have a name to be announced by
INTERACTIVE = {_R.Button, _R.PushButton, _R.CheckBox, _R.RadioButton, _R.ComboBox,
               _R.EditableText, _R.SpinBox, _R.Slider, _R.ListItem, _R.Cell, _R.PageTab,
               _R.Link, _R.ButtonMenu, _R.ButtonDropDown, _R.ButtonDropGrid, _R.Grip,
               _R.MenuItem, _R.TreeItem}


def accessible_nodes(widget: QWidget) -> list[tuple[Any, str, str, Any]]:
    """(role, name, class, object) of every node a screen reader can reach under `widget`
    through Qt's accessibility interfaces (what VoiceOver and Orca walk): widgets, and the
    items of views (messages, chats) that are no widgets of their own."""
    out: list[tuple[Any, str, str, Any]] = []

    def walk(iface: Any) -> None:
        if iface is None or not iface.isValid() or iface.state().invisible:
            return
        if iface.rect().isEmpty():
            return  # nothing on screen (a collapsed header, an empty view's corner)
        obj = iface.object()
        cls = obj.metaObject().className() if obj is not None else "item"
        out.append((iface.role(), iface.text(QAccessible.Text.Name).strip(), cls, obj))
        for i in range(iface.childCount()):
            walk(iface.child(i))

    walk(QAccessible.queryAccessibleInterface(widget))
    return out


def unnamed_interactive(widget: QWidget) -> list[str]:
    return [f"{role.name} {cls}" for role, name, cls, _ in accessible_nodes(widget)
            if role in INTERACTIVE and not name]
