"""The KV monitor's zoom, the way a user zooms: the panel's buttons, +/−/0 on the map and
Ctrl+wheel (no model: a synthetic 16,384-block pool through the real EngineBridge signal)."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QApplication

from bench.monitor_paint import SyntheticPool


def wheel(widget, dy: int, modifiers=Qt.KeyboardModifier.NoModifier) -> bool:
    pos = QPointF(widget.rect().center())
    event = QWheelEvent(pos, QPointF(widget.mapToGlobal(pos.toPoint())), QPoint(0, 0),
                        QPoint(0, dy), Qt.MouseButton.NoButton, modifiers,
                        Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, event)
    return event.isAccepted()


def test_zoom_by_buttons_keys_and_ctrl_wheel(qtbot, qasync_loop, app_env):
    from app.bridges.engine_bridge import EngineBridge
    from app.monitor import create_monitor

    bridge = EngineBridge()
    panel = create_monitor(bridge)
    qtbot.addWidget(panel)
    panel.resize(420, 600)
    panel.show()
    bridge.snapshotUpdated.emit(SyntheticPool(16384, seed=1).snapshot())
    block_map = panel.block_map
    qtbot.waitUntil(lambda: block_map.grid is not None)
    fit = block_map.grid.per_cell
    assert fit > 2 and block_map.zoom == 0
    assert not panel.zoom_out_button.isEnabled() and panel.zoom_in_button.isEnabled()

    qtbot.mouseClick(panel.zoom_in_button, Qt.MouseButton.LeftButton)
    assert block_map.grid.per_cell == fit // 2 and panel.zoom_out_button.isEnabled()
    qtbot.mouseClick(panel.zoom_out_button, Qt.MouseButton.LeftButton)
    assert block_map.grid.per_cell == fit

    block_map.setFocus()
    qtbot.keyClick(block_map, Qt.Key.Key_Plus)
    qtbot.keyClick(block_map, Qt.Key.Key_Plus)
    assert block_map.grid.per_cell == fit // 4
    qtbot.keyClick(block_map, Qt.Key.Key_Minus)
    assert block_map.grid.per_cell == fit // 2
    qtbot.keyClick(block_map, Qt.Key.Key_0)
    assert block_map.grid.per_cell == fit and block_map.zoom == 0

    assert wheel(block_map, 120, Qt.KeyboardModifier.ControlModifier)
    assert block_map.grid.per_cell == fit // 2
    assert not wheel(block_map, 120)  # a plain wheel scrolls (left to the scroll area)
    assert block_map.grid.per_cell == fit // 2
    assert wheel(block_map, -120, Qt.KeyboardModifier.ControlModifier)
    assert block_map.grid.per_cell == fit

    qtbot.mouseClick(panel.zoom_in_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(panel.zoom_fit_button, Qt.MouseButton.LeftButton)
    assert block_map.grid.per_cell == fit and not panel.zoom_fit_button.isEnabled()
    bridge.shutdown()
