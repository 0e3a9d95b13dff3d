"""PagedChat desktop application (PySide6 + qasync).

Layers, top to bottom (pyproject.toml's import contracts keep them): main (entry) > self_test,
demo > main_window > actions (the command table) > pane_deck, banners, settings_flow > chat/,
monitor/,
sidebar, settings_dialog > forms, engine_bridge (the only door to the engine), theme > small
Qt helpers (icons, colors, resources, qt_util, display, qt_compat) > core/ (no Qt at all).
"""

from app import qt_compat

qt_compat.apply()  # before any signal is emitted: see app/qt_compat.py
