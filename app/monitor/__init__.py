"""The KV-block memory monitor: the shared block pool, live, as the user chats.

`create_monitor(bridge, parent)` is what the main window's "kvMonitorDock" calls. Modules, one
job each: pool_state (snapshot -> per-block/per-cell arrays), grid (cell geometry and zoom),
cell_colors (visual grammar), raster (numpy rasteriser), block_map (the painted widget),
key (map key), legend (per-chat model/view), counters, timeline, chats (titles, pane focus and
hover from the main window), monitor (the panel wiring them together).
"""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import QWidget

from app.monitor.chats import ChatDirectory
from app.monitor.monitor import MonitorPanel

__all__ = ["ChatDirectory", "MonitorPanel", "create_monitor", "find_main_window"]


def find_main_window(widget: QWidget | None) -> Any:
    """The nearest ancestor that knows the chats (has `all_sessions`), or None.

    A floating dock is its own top-level window but keeps the main window as its parent, so
    this walks parents rather than using `widget.window()`.
    """
    w = widget
    while w is not None:
        if hasattr(w, "all_sessions") and hasattr(w, "pane_for"):
            return w
        w = w.parentWidget()
    return None


def create_monitor(bridge: Any, parent: QWidget | None = None) -> QWidget:
    """The monitor panel for the main window's dock (`parent` is the dock)."""
    directory = ChatDirectory(find_main_window(parent))
    panel = MonitorPanel(bridge, directory, parent)
    directory.setParent(panel)
    return panel
