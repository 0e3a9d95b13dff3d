"""Locating bundled resources (themes, icons) in a source tree and in a frozen app.

Every lookup of a file shipped with the app goes through :func:`resource_path`, so the source
tree and a PyInstaller bundle (packaging/pagedchat.spec) differ in one place only:

- from source, ``relative`` is under the project root (the folder holding ``resources/``);
- frozen (``sys.frozen``), PyInstaller unpacks data under ``sys._MEIPASS``: the folder next to
  the executable on Linux (``dist/PagedChat/_internal``), ``Contents/Frameworks`` in a macOS
  ``.app``, where PyInstaller 6 puts data files in ``Contents/Resources`` and links them into
  ``Contents/Frameworks``; ``Contents/Resources`` is searched too, in case the links are
  missing (e.g. after a copy that dropped symlinks).

The engine must not import app/, so engine/attention/plans.py finds ``shaders/`` with the same rule
(its own package root, or ``sys._MEIPASS`` when frozen).
"""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtGui import QIcon

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # app/ui/resources.py -> the checkout


def resource_roots() -> list[Path]:
    """The folders shipped files are looked up in, best first."""
    if not getattr(sys, "frozen", False):
        return [SOURCE_ROOT]
    roots = []
    base = getattr(sys, "_MEIPASS", None)
    if base:
        roots.append(Path(base))
    exe_dir = Path(sys.executable).resolve().parent
    if exe_dir.name == "MacOS" and exe_dir.parent.name == "Contents":
        roots.append(exe_dir.parent / "Resources")  # macOS .app bundle
    roots.append(exe_dir)
    return roots


def resource_path(relative: str | Path) -> Path:
    """The path of a shipped file or folder, e.g. ``resource_path("resources/dark.qss")``.

    Returns the first root where it exists; if none has it, the path under the best root (so
    an error message names where it was expected).
    """
    roots = resource_roots()
    for root in roots:
        path = root / relative
        if path.exists():
            return path
    return roots[0] / relative


def resources_dir() -> Path:
    """The ``resources/`` folder: icons and the .qss themes."""
    return resource_path("resources")


def app_icon_path() -> Path | None:
    """The app icon file Qt can load (the vector one first), or None if none is shipped."""
    for name in ("icon.svg", "icon.png"):
        path = resources_dir() / name
        if path.exists():
            return path
    return None


def app_icon() -> QIcon:
    path = app_icon_path()
    return QIcon(str(path)) if path else QIcon()
