"""PagedChat desktop application (PySide6 + qasync).

Rooms, top to bottom (pyproject.toml's import contracts keep them; docs/ARCHITECTURE.md
§6.1): main (entry) > self_test, demo > window > library > chat, monitor > settings >
bridges (the only doors to the engine and to remote providers), startup, ui (small Qt
helpers) > core (no Qt at all), server (the OpenAI-compatible server, no Qt).
"""

from app.ui import qt_compat

qt_compat.apply()  # before any signal is emitted: see app/ui/qt_compat.py
