"""Rasterise the cell grid into a pixel array with numpy (no Qt, no per-cell Python loop).

Drawing thousands of cells with one QPainter call each costs several milliseconds in Python;
every cell here is the same tile shape, so the whole image is one broadcast over an array shaped
(rows, pitch, cols, pitch). Each cell is up to three horizontal bands stacked from the bottom
(e.g. filled slots, allocated-but-empty slots, nothing), optionally split along its diagonal
between two chats, hatched (cached prefix blocks) and marked in its top-right corner (shared).
The caller wraps the result in a QImage (Format_RGB32: 0xffRRGGBB per pixel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.monitor.grid import Grid


@dataclass(frozen=True)
class CellPaint:
    """Per-cell drawing instructions (arrays of length grid.cells).

    Bands from the bottom: band 1 is `h1` px tall in `c1`, band 2 reaches `h2` px in `c2`,
    the rest is `c3`. `split` cells draw their lower-right half with `a1`/`a2` instead of
    `c1`/`c2`. `hatch` (0, 1 or 2) stripes that band with `hatch_color`. `mark` cells get a
    corner triangle.
    """

    c1: np.ndarray
    c2: np.ndarray
    c3: np.ndarray
    h1: np.ndarray
    h2: np.ndarray
    a1: np.ndarray
    a2: np.ndarray
    split: np.ndarray
    hatch: np.ndarray
    hatch_color: np.ndarray
    mark: np.ndarray


def rgb32(r: int, g: int, b: int) -> int:
    return 0xFF000000 | (r << 16) | (g << 8) | b


def blend(colors: np.ndarray | int, toward: int, amount: float) -> np.ndarray:
    """Mix uint32 colours toward another colour (amount 0 = unchanged, 1 = `toward`)."""
    c = np.asarray(colors, dtype=np.uint32)
    out = np.full(c.shape, 0xFF000000, dtype=np.uint32)
    for shift in (16, 8, 0):
        a = ((c >> shift) & 0xFF).astype(np.float32)
        b = float((toward >> shift) & 0xFF)
        out |= (np.rint(a + (b - a) * amount).astype(np.uint32) & 0xFF) << shift
    return out


def rasterize(
    paint: CellPaint,
    grid: Grid,
    row0: int,
    row1: int,
    background: int,
    mark_color: int,
    stripe: int = 3,
) -> np.ndarray:
    """Pixels of grid rows [row0, row1) as uint32, shape ((row1-row0)*pitch, cols*pitch)."""
    row0 = max(0, row0)
    row1 = max(row0, min(row1, grid.rows))
    return rasterize_rows(paint, grid, np.arange(row0, row1), background, mark_color, stripe)


def rasterize_rows(
    paint: CellPaint,
    grid: Grid,
    rows: np.ndarray,
    background: int,
    mark_color: int,
    stripe: int = 3,
) -> np.ndarray:
    """Pixels of the given grid rows stacked in that order (one numpy pass for any set of
    rows, so redrawing 20 scattered rows costs about as much as one)."""
    pitch, size, cols = grid.pitch, grid.cell_size, grid.cols
    rows = np.asarray(rows, dtype=np.int64)
    nrows = len(rows)
    if nrows == 0 or cols == 0:
        return np.full((0, cols * pitch), background, dtype=np.uint32)
    index = (rows[:, None] * cols + np.arange(cols)[None, :]).reshape(-1)
    present = index < grid.cells
    index = np.where(present, index, 0)
    all_present = bool(present.all())

    def window(a: np.ndarray, pad: int) -> np.ndarray:
        w = a[index]
        if not all_present:
            w = np.where(present, w, np.asarray(pad, dtype=a.dtype))
        return w.reshape(nrows, cols)

    h1 = window(paint.h1, 0)
    h2 = window(paint.h2, 0)
    c1 = window(paint.c1, background)
    c2 = window(paint.c2, background)
    c3 = window(paint.c3, background)
    level = (size - 1 - np.arange(pitch)).reshape(1, pitch, 1, 1)  # px above the bottom
    base = np.where(
        level < h1[:, None, :, None],
        c1[:, None, :, None],
        np.where(level < h2[:, None, :, None], c2[:, None, :, None], c3[:, None, :, None]),
    )
    out = np.empty((nrows, pitch, cols, pitch), dtype=np.uint32)
    out[...] = base
    ys = np.arange(pitch).reshape(pitch, 1)
    xs = np.arange(pitch).reshape(1, pitch)
    lv = level.reshape(pitch, 1)

    split = window(paint.split, False)
    if split.any():
        ri, ci = np.nonzero(split)
        a1 = window(paint.a1, background)[ri, ci][:, None, None]
        a2 = window(paint.a2, background)[ri, ci][:, None, None]
        hh1 = h1[ri, ci][:, None, None]
        hh2 = h2[ri, ci][:, None, None]
        lower_right = (xs + ys) >= size  # below the anti-diagonal
        alt = np.where(lv < hh1, a1, np.where(lv < hh2, a2, c3[ri, ci][:, None, None]))
        sub = out[ri, :, ci, :]
        out[ri, :, ci, :] = np.where(lower_right, alt, sub)

    hatch = window(paint.hatch, 0)
    if hatch.any():
        ri, ci = np.nonzero(hatch)
        band = hatch[ri, ci][:, None, None]
        hh1 = h1[ri, ci][:, None, None]
        hh2 = h2[ri, ci][:, None, None]
        in_band = np.where(band == 1, lv < hh1, (lv >= hh1) & (lv < hh2))
        stripes = ((xs + ys) // max(1, stripe)) % 2 == 0
        color = window(paint.hatch_color, background)[ri, ci][:, None, None]
        sub = out[ri, :, ci, :]
        out[ri, :, ci, :] = np.where(in_band & stripes, color, sub)

    mark = window(paint.mark, False)
    if mark.any():
        ri, ci = np.nonzero(mark)
        t = max(2, size * 2 // 5)
        corner = (xs - ys) >= size - t
        sub = out[ri, :, ci, :]
        out[ri, :, ci, :] = np.where(corner, np.uint32(mark_color), sub)

    gap = pitch - size
    if gap:
        out[:, size:, :, :] = background
        out[:, :, :, size:] = background
    if size >= 8:  # soften the corners a little
        for y, x in ((0, 0), (0, size - 1), (size - 1, 0), (size - 1, size - 1)):
            out[:, y, :, x] = background
    return out.reshape(nrows * pitch, cols * pitch)  # padding cells are all background
