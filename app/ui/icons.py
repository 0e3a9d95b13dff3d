"""Toolbar and message-action icons, drawn from tiny inline SVGs in the current text colour.

Inline SVG keeps the app free of binary assets and lets one outline set follow the theme:
`icon(name)` renders the glyph with the palette's text colour (and a dimmer one when disabled),
so icons stay legible in light and dark mode.
"""

from __future__ import annotations

import base64
from functools import lru_cache

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QRectF, QSize, Qt
from PySide6.QtGui import (
    QColor,
    QFont,
    QFontMetrics,
    QGuiApplication,
    QIcon,
    QImage,
    QPainter,
    QPalette,
    QPixmap,
)
from PySide6.QtSvg import QSvgRenderer

_STROKE = (
    'fill="none" stroke="{c}" stroke-width="1.8" stroke-linecap="round" stroke-linejoin="round"'
)

GLYPHS: dict[str, str] = {
    "new-chat": '<path d="M12 20h9"/><path d="M16.5 3.5a2.1 2.1 0 0 1 3 3L7 19l-4 1 1-4Z"/>',
    "split": '<rect x="3" y="4" width="18" height="16" rx="2"/><path d="M12 4v16"/>',
    "send-all": '<path d="M4 12h10"/><path d="M10 6l6 6-6 6"/><path d="M19 5v14"/>',
    "settings": (
        '<circle cx="12" cy="12" r="3"/><path d="M12 2v3M12 19v3M4.9 4.9l2.1 2.1M17 17l2.1 2.1'
        'M2 12h3M19 12h3M4.9 19.1 7 17M17 7l2.1-2.1"/>'
    ),
    "send": '<path d="M12 19V5"/><path d="M5 12l7-7 7 7"/>',
    "stop": '<rect x="6" y="6" width="12" height="12" rx="2" fill="{c}"/>',
    "copy": '<rect x="9" y="9" width="11" height="11" rx="2"/><path d="M5 15V5a2 2 0 0 1 2-2h8"/>',
    "edit": '<path d="M16.5 3.5a2.1 2.1 0 0 1 3 3L7 19l-4 1 1-4Z"/>',
    "regenerate": '<path d="M20 11a8 8 0 1 0-2.3 5.7"/><path d="M20 4v7h-7"/>',
    "branch": (
        '<circle cx="6" cy="5" r="2"/><circle cx="6" cy="19" r="2"/>'
        '<circle cx="18" cy="8" r="2"/>'
        '<path d="M6 7v10"/><path d="M18 10c0 5-12 3-12 7"/>'
    ),
    "prev": '<path d="M15 18l-6-6 6-6"/>',
    "next": '<path d="M9 18l6-6-6-6"/>',
    "close": '<path d="M6 6l12 12M18 6L6 18"/>',
    "sliders": (
        '<path d="M4 6h10M18 6h2M4 12h4M12 12h8M4 18h12M20 18h0"/>'
        '<circle cx="16" cy="6" r="2"/><circle cx="10" cy="12" r="2"/>'
        '<circle cx="18" cy="18" r="2"/>'
    ),
    "monitor": (
        '<rect x="3" y="3" width="7" height="7" rx="1"/>'
        '<rect x="14" y="3" width="7" height="7" rx="1"/>'
        '<rect x="3" y="14" width="7" height="7" rx="1"/>'
        '<rect x="14" y="14" width="7" height="7" rx="1"/>'
    ),
    "models": (
        '<path d="M12 3l8 4.5v9L12 21l-8-4.5v-9Z"/><path d="M4 7.5l8 4.5 8-4.5"/>'
        '<path d="M12 12v9"/>'
    ),
    "sidebar": '<rect x="3" y="4" width="18" height="16" rx="2"/><path d="M9 4v16"/>',
    "search": '<circle cx="11" cy="11" r="6"/><path d="M20 20l-4.5-4.5"/>',
    "paperclip": (
        '<path d="M20 11.5l-8 8a5 5 0 0 1-7-7l8.5-8.5a3.3 3.3 0 0 1 4.7 4.7L9.7 17.2'
        'a1.7 1.7 0 0 1-2.4-2.4L15 7.1"/>'
    ),
    "chip": (
        '<rect x="6" y="6" width="12" height="12" rx="2"/>'
        '<path d="M9 2v4M15 2v4M9 18v4M15 18v4M2 9h4M2 15h4M18 9h4M18 15h4"/>'
    ),
}


def svg(name: str, color: str, opacity: float = 1.0) -> bytes:
    """The SVG text of a glyph; `color` is #rrggbb (SVG has no #aarrggbb)."""
    body = GLYPHS[name].replace("{c}", color)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" opacity="{opacity:.2f}" '
        f"{_STROKE.format(c=color)}>{body}</svg>"
    ).encode()


@lru_cache(maxsize=512)
def pixmap(name: str, color: str, size: int, dpr: float = 1.0, opacity: float = 1.0) -> QPixmap:
    """The glyph rendered at `size` logical pixels (crisp on high-DPI screens)."""
    px = max(1, round(size * dpr))
    image = QImage(px, px, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    renderer = QSvgRenderer(QByteArray(svg(name, color, opacity)))
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter, QRectF(0, 0, px, px))
    painter.end()
    pm = QPixmap.fromImage(image)
    pm.setDevicePixelRatio(dpr)
    return pm


def icon(name: str, color: QColor | str | None = None, size: int = 18) -> QIcon:
    """A QIcon for buttons and actions, in the palette's text colour unless `color` is given."""
    pal = QGuiApplication.palette()
    normal = QColor(color) if color is not None else pal.color(QPalette.ColorRole.ButtonText)
    screen = QGuiApplication.primaryScreen()
    dpr = screen.devicePixelRatio() if screen else 1.0
    hex_rgb = normal.name(QColor.NameFormat.HexRgb)
    ic = QIcon()
    ic.addPixmap(pixmap(name, hex_rgb, size, dpr, normal.alphaF()), QIcon.Mode.Normal)
    ic.addPixmap(pixmap(name, hex_rgb, size, dpr, 0.35 * normal.alphaF()), QIcon.Mode.Disabled)
    return ic


def icon_size(size: int = 18) -> QSize:
    return QSize(size, size)


@lru_cache(maxsize=64)
def data_uri(name: str, color: str, size: int, dpr: float = 2.0) -> str:
    """The glyph as a PNG data: URI, for rich text (a sent message's attachment chips): drawn
    like the buttons' icons, so it shows in every font (an emoji showed a box in most)."""
    ba = QByteArray()
    buffer = QBuffer(ba)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    pixmap(name, color, size, dpr).toImage().save(buffer, "PNG")
    buffer.close()
    return "data:image/png;base64," + base64.b64encode(bytes(ba)).decode("ascii")


def drawable(text: str, fallback: str, font: QFont | None = None) -> str:
    """`text` if the font (the application's unless given) has every character of it, else
    `fallback`: a graceful substitute ("x" for "✕") instead of a box."""
    fm = QFontMetrics(font if font is not None else QGuiApplication.font())
    return text if all(fm.inFontUcs4(ord(ch)) for ch in text) else fallback
