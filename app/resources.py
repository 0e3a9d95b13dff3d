"""Locating bundled resources (themes, icons) in a source tree and in a frozen app."""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtGui import QIcon


def resources_dir() -> Path:
    base = getattr(sys, "_MEIPASS", None)  # PyInstaller bundle
    if base:
        return Path(base) / "resources"
    return Path(__file__).resolve().parent.parent / "resources"


def app_icon() -> QIcon:
    for name in ("icon.svg", "icon.png"):
        path = resources_dir() / name
        if path.exists():
            return QIcon(str(path))
    return QIcon()
