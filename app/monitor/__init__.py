"""The KV-block memory monitor: the shared block pool, live, as the user chats.

`create_monitor_dock(bridge, chats, window)` is the main window's "kvMonitorDock".
Modules, one job each: pool_state (snapshot -> per-block/per-cell arrays), grid (cell
geometry and zoom), cell_colors (visual grammar), raster (numpy rasteriser), block_map (the
painted widget), key (map key), legend (per-chat model/view), counters, timeline, chats (the
protocol through which the app tells titles, colours, focus and hover), monitor (the panel
wiring them together).
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDockWidget, QLabel, QWidget

from app.monitor.chats import Chats, NoChats
from app.monitor.monitor import MonitorPanel

__all__ = ["Chats", "MonitorPanel", "NoChats", "create_monitor", "create_monitor_dock"]


def create_monitor(
    bridge: Any, chats: Chats | None = None, parent: QWidget | None = None
) -> MonitorPanel:
    """The monitor panel on `bridge`'s snapshots, for `chats` (None: no app around it)."""
    return MonitorPanel(bridge, chats, parent)


def create_monitor_dock(bridge: Any, chats: Chats, parent: QWidget) -> QDockWidget:
    """The "KV Cache" dock (right or bottom) holding the monitor; a monitor that fails to
    start shows why instead of keeping the app from starting."""
    dock = QDockWidget("KV Cache", parent)
    dock.setObjectName("kvMonitorDock")
    dock.setAccessibleName("KV cache monitor")
    dock.setAllowedAreas(
        Qt.DockWidgetArea.RightDockWidgetArea | Qt.DockWidgetArea.BottomDockWidgetArea
    )
    try:
        dock.setWidget(create_monitor(bridge, chats, dock))
    except Exception as exc:
        label = QLabel(f"The KV monitor failed to start: {exc}")
        label.setWordWrap(True)
        dock.setWidget(label)
    return dock
