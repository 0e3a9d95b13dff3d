"""Light and dark looks: palette, stylesheet (resources/*.qss) and the markdown colours.

The "system" setting follows QStyleHints.colorScheme and switches live when the OS does. Code
that caches colours (rendered messages, icons) listens to `theme_manager().changed`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from app.ui.resources import resources_dir


@dataclass(frozen=True)
class MarkdownTheme:
    """Colours the markdown HTML needs (app/chat/markdown.py); the rest is the palette's."""

    dark: bool = False
    code_bg: str = "#f4f5f7"
    code_header_bg: str = "#e8eaee"
    code_header_fg: str = "#5f6672"
    inline_code_bg: str = "#eceef1"
    link: str = "#0a66d8"
    quote_fg: str = "#6b7280"
    rule: str = "#d7dae0"
    pygments_style: str = "friendly"


MARKDOWN_LIGHT = MarkdownTheme()
MARKDOWN_DARK = MarkdownTheme(
    dark=True,
    code_bg="#1c1d21",
    code_header_bg="#2a2c31",
    code_header_fg="#a3a8b3",
    inline_code_bg="#34363c",
    link="#5aa9ff",
    quote_fg="#9aa0aa",
    rule="#3a3c42",
    pygments_style="github-dark",
)


_LIGHT = {
    "window": "#f3f3f5",
    "base": "#ffffff",
    "alt": "#ececef",
    "text": "#1d1d1f",
    "button": "#ffffff",
    "highlight": "#0a7cff",
    "muted": "#6e6e73",
    "mid": "#d2d2d7",
    "tooltip": "#ffffff",
}
_DARK = {
    "window": "#1c1c1e",
    "base": "#232326",
    "alt": "#2c2c2f",
    "text": "#f2f2f7",
    "button": "#2c2c2f",
    "highlight": "#0a84ff",
    "muted": "#98989f",
    "mid": "#3a3a3d",
    "tooltip": "#2c2c2f",
}


def _palette(colors: dict[str, str]) -> QPalette:
    p = QPalette()
    c = {k: QColor(v) for k, v in colors.items()}
    R = QPalette.ColorRole
    for role, key in (
        (R.Window, "window"),
        (R.Base, "base"),
        (R.AlternateBase, "alt"),
        (R.Text, "text"),
        (R.WindowText, "text"),
        (R.ButtonText, "text"),
        (R.Button, "button"),
        (R.Highlight, "highlight"),
        (R.ToolTipBase, "tooltip"),
        (R.ToolTipText, "text"),
        (R.PlaceholderText, "muted"),
        (R.Mid, "mid"),
        (R.Midlight, "alt"),
        (R.Link, "highlight"),
    ):
        p.setColor(role, c[key])
    p.setColor(R.HighlightedText, QColor("#ffffff"))
    p.setColor(R.BrightText, QColor("#ffffff"))
    for role in (R.Text, R.WindowText, R.ButtonText):
        dim = QColor(c["text"])
        dim.setAlphaF(0.4)
        p.setColor(QPalette.ColorGroup.Disabled, role, dim)
    return p


class ThemeManager(QObject):
    changed = Signal(bool)  # dark?

    def __init__(self) -> None:
        super().__init__()
        self.setting = "system"
        self.dark = False
        hints = QGuiApplication.styleHints()
        if hasattr(hints, "colorSchemeChanged"):
            hints.colorSchemeChanged.connect(self._system_changed)

    def system_is_dark(self) -> bool:
        hints = QGuiApplication.styleHints()
        scheme = hints.colorScheme() if hasattr(hints, "colorScheme") else None
        return scheme == Qt.ColorScheme.Dark

    def apply(self, setting: str = "system") -> None:
        """Apply "system", "light" or "dark" to the whole application."""
        self.setting = setting if setting in ("system", "light", "dark") else "system"
        dark = self.system_is_dark() if self.setting == "system" else self.setting == "dark"
        app = QApplication.instance()
        if app is None:
            return
        if sys.platform != "darwin":
            app.setStyle("Fusion")  # consistent, palette-driven look off the Mac
        app.setPalette(_palette(_DARK if dark else _LIGHT))
        qss = resources_dir() / ("dark.qss" if dark else "light.qss")
        try:
            app.setStyleSheet(qss.read_text(encoding="utf-8"))
        except OSError:
            app.setStyleSheet("")
        self.dark = dark
        self.changed.emit(dark)

    def _system_changed(self, *_args: object) -> None:
        if self.setting == "system":
            self.apply("system")

    def markdown_theme(self) -> MarkdownTheme:
        return MARKDOWN_DARK if self.dark else MARKDOWN_LIGHT

    def color(self, key: str) -> QColor:
        return QColor((_DARK if self.dark else _LIGHT)[key])


_manager: ThemeManager | None = None


def theme_manager() -> ThemeManager:
    global _manager
    if _manager is None:
        _manager = ThemeManager()
    return _manager
