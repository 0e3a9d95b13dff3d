"""From cell state to drawing instructions: which colours, how tall each band (numpy, no Qt).

This is the visual grammar of the map, in one place:
- a held block is its chat's colour; the part of it holding tokens is solid, the allocated but
  still empty slots are a pale tint of the same colour (so waste is visible);
- a block shared by several sequences gets a corner mark (or, when cells are large enough, a
  badge with its refcount, drawn by the widget); shared by two chats, it is split diagonally
  between both chats' colours;
- a cached prefix block (refcount 0, still reusable) is dimmed and hatched, tinted by the chat
  that last held it;
- a free block is an empty cell;
- when cells fold several blocks, the bottom band is the share of used blocks (in the colour of
  the chat holding most of them), the hatched band above it the share of cached blocks.
A highlighted chat keeps its colours; every other cell fades toward the background.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.monitor.pool_state import Cells
from app.monitor.raster import CellPaint, blend


@dataclass(frozen=True)
class Palette:
    """Colours (0xffRRGGBB) the map uses; session tables end with a neutral entry (index -1)."""

    background: int
    empty: int
    mark: int
    neutral: int
    full: np.ndarray  # per session index, + neutral
    pale: np.ndarray
    cached: np.ndarray
    cached_hatch: np.ndarray
    dark: bool


def session_tables(
    accents: list[int], background: int, empty: int, neutral: int, dark: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Solid, pale (empty slots), cached and cached-hatch colours for each session colour.

    Dimming toward a dark background loses more legibility than toward a light one, so
    cached blocks keep more of their colour in the dark theme: there, every chat colour's
    cached cell is at least as far (CIE ΔE) from a free cell as in the light theme, and at
    least 20 (tests/test_app_defects.py); at 0.5/0.68 the brown one was at 16.7. In the
    light theme too every cached cell is at least 20 from a free one (at 0.6/0.76 the brown
    one was at 10.9 and the teal one at 16.7: cached blocks of those chats all but vanished).
    """
    full = np.array([*accents, neutral], dtype=np.uint32)
    pale = blend(full, empty, 0.62)
    cached = blend(full, background, 0.33 if dark else 0.38)
    hatch = blend(full, background, 0.52 if dark else 0.56)
    return full, pale, cached, hatch


def _band(fraction: np.ndarray, size: int) -> np.ndarray:
    """Pixels for a fraction of a cell; anything above zero shows at least one pixel."""
    px = np.rint(np.clip(fraction, 0.0, 1.0) * size).astype(np.int32)
    return np.where((fraction > 0) & (px == 0), 1, px)


def plan(
    cells: Cells,
    block_size: int,
    palette: Palette,
    size: int,
    highlight: np.ndarray | None = None,
    corner_marks: bool = True,
) -> CellPaint:
    """Drawing instructions for every cell; `highlight` is a per-cell bool mask (or None)."""
    n = cells.count
    used = cells.used > 0
    dom, second = cells.dominant, cells.second
    empty = np.full(n, palette.empty, dtype=np.uint32)
    if cells.per_cell == 1:
        cached_only = (cells.cached > 0) & ~used
        h1 = np.where(
            used,
            _band(cells.used_slots / max(1, block_size), size),
            np.where(cached_only, size, 0),
        ).astype(np.int32)
        h2 = np.where(used, size, h1).astype(np.int32)
        c1 = np.where(used, palette.full[dom], palette.cached[cells.last_owner])
        c2 = palette.pale[dom]
        hatch = np.where(cached_only, 1, 0).astype(np.int8)
    else:
        present = np.maximum(cells.present, 1)
        h1 = _band(cells.used / present, size)
        h2 = np.minimum(size, h1 + _band(cells.cached / present, size)).astype(np.int32)
        c1 = palette.full[dom]
        c2 = palette.cached[cells.last_owner]
        hatch = np.where(cells.cached > 0, 2, 0).astype(np.int8)
    split = used & (second >= 0)
    a1 = palette.full[second]
    a2 = palette.pale[second]
    hatch_color = palette.cached_hatch[cells.last_owner]
    mark = (cells.shared > 0) if corner_marks else np.zeros(n, dtype=bool)
    c1, c2, c3 = c1.astype(np.uint32), c2.astype(np.uint32), empty
    if highlight is not None:
        off = ~highlight
        fade = palette.background
        c1 = np.where(off, blend(c1, fade, 0.78), c1)
        c2 = np.where(off, blend(c2, fade, 0.78), c2)
        a1 = np.where(off, blend(a1, fade, 0.78), a1)
        a2 = np.where(off, blend(a2, fade, 0.78), a2)
        hatch_color = np.where(off, blend(hatch_color, fade, 0.78), hatch_color)
        c3 = np.where(off, blend(c3, fade, 0.5), c3)
        mark = mark & highlight
    return CellPaint(
        c1=c1,
        c2=c2.astype(np.uint32),
        c3=c3.astype(np.uint32),
        h1=h1.astype(np.int32),
        h2=h2.astype(np.int32),
        a1=a1.astype(np.uint32),
        a2=a2.astype(np.uint32),
        split=split,
        hatch=hatch,
        hatch_color=hatch_color.astype(np.uint32),
        mark=mark,
    )


def changed_cells(before: CellPaint, after: CellPaint) -> np.ndarray:
    """Cells whose drawing instructions differ (both plans must have the same cell count)."""
    changed = np.zeros(before.c1.shape[0], dtype=bool)
    for name in CellPaint.__dataclass_fields__:
        changed |= getattr(before, name) != getattr(after, name)
    return changed
