"""PagedChat desktop application (PySide6 + qasync)."""

from app import qt_compat

qt_compat.apply()  # before any signal is emitted: see app/qt_compat.py
