"""Theme colours of the monitor, derived from the widget's QPalette (light and dark alike).

The app's ThemeManager sets the application palette; deriving every monitor colour from it
(instead of hard-coding two themes) keeps the panel consistent with the rest of the window and
makes a theme switch a simple re-derivation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from PySide6.QtGui import QColor, QPalette

from app.monitor.cell_colors import Palette, session_tables
from app.monitor.raster import blend
from app.ui import colors


def to_rgb32(color: QColor) -> int:
    return 0xFF000000 | (color.red() << 16) | (color.green() << 8) | color.blue()


def from_rgb32(value: int, alpha: float = 1.0) -> QColor:
    c = QColor((int(value) >> 16) & 0xFF, (int(value) >> 8) & 0xFF, int(value) & 0xFF)
    c.setAlphaF(alpha)
    return c


def is_dark(palette: QPalette) -> bool:
    return palette.color(QPalette.ColorRole.Window).lightness() < 128


def mix(a: QColor, b: QColor, amount: float) -> QColor:
    """`a` moved `amount` of the way toward `b` (opaque; plain ints, called per paint)."""
    return QColor(
        round(a.red() + (b.red() - a.red()) * amount),
        round(a.green() + (b.green() - a.green()) * amount),
        round(a.blue() + (b.blue() - a.blue()) * amount),
    )


def surface(palette: QPalette) -> QColor:
    """The panel's background: the window colour, a touch darker/lighter than chat panes."""
    return QColor(palette.color(QPalette.ColorRole.Base))


def muted_text(palette: QPalette) -> QColor:
    return QColor(palette.color(QPalette.ColorRole.PlaceholderText))


def map_palette(
    palette: QPalette,
    session_ids: Iterable[str],
    color_of: Callable[[str], QColor] = colors.accent_color,
) -> Palette:
    """The block map's colours for these sessions (in SessionIndex order)."""
    dark = is_dark(palette)
    bg = surface(palette)
    text = palette.color(QPalette.ColorRole.Text)
    background = to_rgb32(bg)
    empty = int(blend(background, to_rgb32(text), 0.075 if dark else 0.065))
    neutral = int(blend(background, to_rgb32(text), 0.45))
    accents = [to_rgb32(color_of(sid)) for sid in session_ids]
    full, pale, cached, hatch = session_tables(accents, background, empty, neutral, dark)
    return Palette(
        background=background,
        empty=empty,
        mark=0xFFFFFFFF if dark else 0xFF1D1D1F,
        neutral=neutral,
        full=full,
        pale=pale,
        cached=cached,
        cached_hatch=hatch,
        dark=dark,
    )
