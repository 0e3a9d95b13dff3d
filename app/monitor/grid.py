"""Where cells go: how many blocks per cell, cell pitch, columns and rows (pure arithmetic).

The map must stay readable from 64 to 16,384 blocks. At zoom 0 ("fit") every block is on screen:
cells are as large as the area allows, up to MAX_PITCH, and when even MIN_PITCH cells would not
fit, consecutive blocks fold into one cell (2, 4, 8... per cell). Each zoom step first halves the
blocks per cell, then grows the cells; the map then scrolls vertically. Everything is in device
pixels so the raster is crisp on high-DPI screens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_PITCH = 5  # logical px per cell including the gap: the smallest a cell may get
MAX_PITCH = 26  # the largest a cell gets when fitting (so 64 blocks do not become slabs)
ZOOM_MAX_PITCH = 48
ZOOM_GROWTH = 1.5


@dataclass(frozen=True)
class Grid:
    """Cell geometry in device pixels; cell i sits at row i // cols, column i % cols."""

    num_blocks: int
    per_cell: int
    cols: int
    pitch: int  # device px from one cell to the next, gap included
    gap: int  # device px between cells
    zoom: int = 0
    can_zoom_in: bool = False

    @property
    def cells(self) -> int:
        return -(-self.num_blocks // self.per_cell) if self.num_blocks else 0

    @property
    def rows(self) -> int:
        return -(-self.cells // self.cols) if self.cells else 0

    @property
    def cell_size(self) -> int:
        return self.pitch - self.gap

    @property
    def width(self) -> int:
        return self.cols * self.pitch

    @property
    def height(self) -> int:
        return self.rows * self.pitch

    def cell_at(self, x: int, y: int) -> int:
        """The cell under device pixel (x, y) of the grid, or -1 (gaps count as their cell)."""
        if x < 0 or y < 0:
            return -1
        col, row = x // self.pitch, y // self.pitch
        if col >= self.cols:
            return -1
        cell = row * self.cols + col
        return cell if cell < self.cells else -1

    def cell_origin(self, cell: int) -> tuple[int, int]:
        return (cell % self.cols) * self.pitch, (cell // self.cols) * self.pitch


def gap_for(pitch_dev: int, dpr: float) -> int:
    logical = pitch_dev / dpr
    if logical < 9:
        return max(1, round(dpr))
    return max(2, round(2 * dpr))


def _fits(cells: int, pitch: int, width: int, height: int) -> bool:
    cols = width // pitch
    return cols >= 1 and -(-cells // cols) * pitch <= height


def fit_grid(num_blocks: int, width: int, height: int, dpr: float = 1.0, zoom: int = 0) -> Grid:
    """The grid showing `num_blocks` in `width` x `height` device px, then zoomed `zoom` steps."""
    n = max(0, int(num_blocks))
    width, height = max(1, int(width)), max(1, int(height))
    lo = max(2, round(MIN_PITCH * dpr))
    hi = max(lo, round(MAX_PITCH * dpr))
    per_cell, pitch = 1, lo
    if n:
        while True:
            cells = -(-n // per_cell)
            best = next((p for p in range(hi, lo - 1, -1) if _fits(cells, p, width, height)), 0)
            if best or per_cell >= n:
                pitch = best or lo
                break
            per_cell *= 2
    top = max(pitch, round(ZOOM_MAX_PITCH * dpr))
    steps = 0
    for _ in range(max(0, int(zoom))):
        if per_cell > 1:
            per_cell //= 2
        elif pitch < top:
            pitch = min(top, math.ceil(pitch * ZOOM_GROWTH))
        else:
            break
        steps += 1
    cols = max(1, width // pitch)
    return Grid(
        num_blocks=n,
        per_cell=per_cell,
        cols=cols,
        pitch=pitch,
        gap=gap_for(pitch, dpr),
        zoom=steps,
        can_zoom_in=per_cell > 1 or pitch < top,
    )
