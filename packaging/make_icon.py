"""Draw PagedChat's app icon with QPainter and write resources/icon.png and PagedChat.icns.

Why a script: the icon is code, so it is reviewable, reproducible (same Qt -> same pixels) and
needs no design tool. It draws the motif of resources/icon.svg (the window icon): a grid of
KV blocks coloured by owning chat (one shared, one cached, one free) above a chat bubble,
inside macOS's icon grid (an 824 px rounded square centred on a 1024 px canvas, so the icon
sits in the Dock at the same size as Apple's own).

Outputs (both committed; run again only when the design changes):
- ``resources/icon.png``: 1024 x 1024, the master image;
- ``resources/PagedChat.icns``: the macOS icon, 16 to 1024 px. On a Mac ``iconutil`` (the
  official tool) makes it from an ``.iconset`` folder; elsewhere Pillow writes the same
  format. ``--iconutil`` insists on iconutil.

Usage: ``.venv/bin/python packaging/make_icon.py [--out-dir resources] [--iconutil]``
(needs the ``package`` extra for Pillow when iconutil is not used).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZE = 1024
#: Apple's macOS icon grid: the body is 824 px with a 100 px margin; corner radius ~185 px.
BODY = 824
MARGIN = (SIZE - BODY) // 2
#: The design is drawn in the 256-unit space of resources/icon.svg, whose body is 8..248.
DESIGN_BODY = (8.0, 240.0)
#: iconset file names and pixel sizes (what iconutil expects).
ICONSET = [
    (f"icon_{s}x{s}{'@2x' if scale == 2 else ''}.png", s * scale)
    for s in (16, 32, 128, 256, 512)
    for scale in (1, 2)
]

BLUE, ORANGE, GREEN, PURPLE = "#0A7CFF", "#F28C28", "#2DB55D", "#A259D9"


def render(size: int = SIZE):
    """The icon as a QImage of ``size`` x ``size`` (transparent outside the body)."""
    from PySide6.QtCore import QPointF, QRectF, Qt
    from PySide6.QtGui import (
        QBrush,
        QColor,
        QImage,
        QLinearGradient,
        QPainter,
        QPainterPath,
        QPen,
        QPolygonF,
    )

    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    p = QPainter(image)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    scale = size / SIZE * BODY / DESIGN_BODY[1]
    offset = size / SIZE * MARGIN - DESIGN_BODY[0] * scale
    p.translate(offset, offset)
    p.scale(scale, scale)

    # Body: a dark rounded square with a diagonal gradient (reads on light and dark Docks).
    body = QRectF(8, 8, 240, 240)
    gradient = QLinearGradient(body.topLeft(), body.bottomRight())
    gradient.setColorAt(0.0, QColor("#2b2f3a"))
    gradient.setColorAt(1.0, QColor("#14161c"))
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QBrush(gradient))
    p.drawRoundedRect(body, 57.5, 57.5)

    # The KV block grid: owned (blue, orange, green), cached (dimmed purple), free (outline).
    def block(x: float, y: float, color: str, alpha: float = 1.0) -> None:
        c = QColor(color)
        c.setAlphaF(alpha)
        p.setBrush(c)
        p.drawRoundedRect(QRectF(x, y, 44, 44), 9, 9)

    block(48, 56, BLUE)
    block(106, 56, BLUE)
    block(164, 56, ORANGE)
    block(48, 114, GREEN)
    block(106, 114, PURPLE, 0.55)
    p.setBrush(Qt.BrushStyle.NoBrush)
    p.setPen(QPen(QColor("#5c6270"), 5))
    p.drawRoundedRect(QRectF(166.5, 116.5, 39, 39), 7, 7)

    # The chat bubble with its tail.
    bubble = QPainterPath()
    bubble.addRoundedRect(QRectF(44, 176, 168, 38), 12, 12)
    tail = QPainterPath()
    tail.addPolygon(QPolygonF([QPointF(98, 212), QPointF(72, 232), QPointF(72, 212)]))
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QColor("#f2f2f7"))
    p.drawPath(bubble.united(tail))
    p.end()
    return image


def write_icns_with_iconutil(png: Path, icns: Path) -> None:
    """Apple's way: an .iconset folder of exact sizes, then ``iconutil -c icns``."""
    with tempfile.TemporaryDirectory() as tmp:
        iconset = Path(tmp) / "PagedChat.iconset"
        iconset.mkdir()
        for name, px in ICONSET:
            render(px).save(str(iconset / name))
        subprocess.run(["iconutil", "-c", "icns", str(iconset), "-o", str(icns)], check=True)


def write_icns_with_pillow(png: Path, icns: Path) -> None:
    """Pillow writes the ICNS container (PNG-encoded renditions) on any platform.

    Each size is rendered by Qt at that size (sharper than downscaling the 1024 px image).
    """
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        renditions = []
        for px in sorted({px for _, px in ICONSET}):
            path = Path(tmp) / f"{px}.png"
            render(px).save(str(path))
            renditions.append(Image.open(path))
        master = Image.open(png)
        master.save(icns, format="ICNS", append_images=renditions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "resources")
    parser.add_argument("--iconutil", action="store_true", help="fail unless iconutil exists")
    args = parser.parse_args(argv)

    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    _app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / "icon.png"
    icns = args.out_dir / "PagedChat.icns"
    if not render().save(str(png)):
        print(f"make_icon: could not write {png}", file=sys.stderr)
        return 1
    if shutil.which("iconutil"):
        write_icns_with_iconutil(png, icns)
    elif args.iconutil:
        print("make_icon: iconutil not found (it ships with macOS)", file=sys.stderr)
        return 1
    else:
        write_icns_with_pillow(png, icns)
    print(f"make_icon: wrote {png} and {icns}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
