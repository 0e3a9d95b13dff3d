"""PagedChat desktop application (PySide6 + qasync)."""
