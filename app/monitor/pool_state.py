"""Per-block and per-cell state derived from one PoolSnapshot (numpy, no Qt).

The block map, its tests and the paint benchmark all need the same derivation: what category
each block is in, which chats own it, and how many blocks fold into one cell when the pool is
too big to draw a cell per block. Keeping it here, free of Qt and vectorised with numpy, makes
it unit-testable with synthetic snapshots and cheap enough at 16,384 blocks to redo at 10 Hz.

Sessions are numbered by a `SessionIndex` that outlives snapshots, so a chat keeps its index
(and its colour lookup) from one frame to the next.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

# Block categories, in the order the map key lists them.
FREE, CACHED, HELD, SHARED = 0, 1, 2, 3
CATEGORY_NAMES = ("free", "cached", "held", "shared")
ABSENT = 255  # padding past the last block when cells aggregate several blocks


def small_ints(values: Iterable[int], n: int) -> np.ndarray:
    """A tuple (or iterator) of ints as an int32 array, fast for the usual small values.

    `bytes()` converts a sequence of ints below 256 in C, several times faster than
    np.array on a tuple; larger values (a refcount above 255) take the general path.
    """
    seq = values if isinstance(values, tuple | list) else list(values)
    try:
        out = np.frombuffer(bytes(seq), dtype=np.uint8).astype(np.int32)
    except ValueError:
        out = np.array(seq, dtype=np.int32)
    if out.shape != (n,):
        raise ValueError(f"expected {n} per-block values, got {out.shape[0]}")
    return out


class SessionIndex:
    """Stable small integers for session ids (index -1 means "nobody")."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def index(self, session_id: str) -> int:
        return self._ids.setdefault(session_id, len(self._ids))

    def session(self, index: int) -> str:
        return self.ids[index]

    @property
    def ids(self) -> list[str]:
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._ids


@dataclass(frozen=True)
class BlockState:
    """What the map drew for one block (read back by tests and the tooltip)."""

    block_id: int
    category: str  # one of CATEGORY_NAMES
    owners: tuple[str, ...]
    refcount: int
    fill: int
    block_size: int
    cached: bool


class PoolState:
    """A snapshot's per-block tuples as numpy arrays plus categories and owner indices.

    owner_code[b] indexes `owner_sets` (the distinct owner tuples of this snapshot; code 0 is
    always the empty tuple); primary[b] / secondary[b] are the session indices of a block's
    first two owners (-1 when there are fewer), which is what the map can show as colours.
    """

    def __init__(self, snap: Any, sessions: SessionIndex) -> None:
        n = int(snap.num_blocks)
        self.num_blocks = n
        self.block_size = int(snap.block_size)
        self.bytes_per_block = int(snap.bytes_per_block)
        self.snapshot = snap
        self.refcount = small_ints(snap.refcounts, n)
        self.fill = small_ints(snap.fills, n)
        self.cached = small_ints(snap.cached, n).astype(bool)
        # distinct owner tuples (code 0 is ()), then each block's code: C-level calls only
        self.owner_sets: list[tuple[str, ...]] = list(dict.fromkeys(((), *snap.owners)))
        codes = {o: i for i, o in enumerate(self.owner_sets)}
        self.owner_code = small_ints(map(codes.__getitem__, snap.owners), n)
        first = np.array(
            [sessions.index(o[0]) if o else -1 for o in self.owner_sets], dtype=np.int32
        )
        second = np.array(
            [sessions.index(o[1]) if len(o) > 1 else -1 for o in self.owner_sets], dtype=np.int32
        )
        self.primary = first[self.owner_code]
        self.secondary = second[self.owner_code]
        category = np.full(n, FREE, dtype=np.uint8)
        category[(self.refcount == 0) & self.cached] = CACHED
        category[self.refcount == 1] = HELD
        category[self.refcount > 1] = SHARED
        self.category = category

    def used_mask(self) -> np.ndarray:
        return self.category >= HELD

    def held_by(self, session_index: int, sessions: SessionIndex) -> np.ndarray:
        """Blocks whose owners include the session (a bool mask)."""
        if session_index < 0 or session_index >= len(sessions):
            return np.zeros(self.num_blocks, dtype=bool)
        sid = sessions.session(session_index)
        has = np.array([sid in o for o in self.owner_sets], dtype=bool)
        return has[self.owner_code]

    def block(self, block_id: int) -> BlockState:
        b = int(block_id)
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block {b} is outside the pool (0..{self.num_blocks - 1})")
        return BlockState(
            block_id=b,
            category=CATEGORY_NAMES[int(self.category[b])],
            owners=self.owner_sets[int(self.owner_code[b])],
            refcount=int(self.refcount[b]),
            fill=int(self.fill[b]),
            block_size=self.block_size,
            cached=bool(self.cached[b]),
        )

    def shared_savings_bytes(self) -> int:
        """Memory sharing saves: each extra reference would otherwise be its own block."""
        extra = np.maximum(self.refcount - 1, 0).sum()
        return int(extra) * self.bytes_per_block


@dataclass(frozen=True)
class Cells:
    """The pool folded into cells of `per_cell` consecutive blocks (all arrays per cell).

    The last cell may hold fewer blocks (`present`). `dominant` is the session holding most
    of a cell's used blocks, `second` the next one (a single block shared by two chats has
    both); `max_ref` the highest refcount inside; `used_slots` the token slots holding
    tokens in used blocks.
    """

    per_cell: int
    count: int
    present: np.ndarray
    used: np.ndarray
    cached: np.ndarray
    shared: np.ndarray
    used_slots: np.ndarray
    max_ref: np.ndarray
    dominant: np.ndarray
    second: np.ndarray
    last_owner: np.ndarray  # for cached-only cells: who held them last (-1 unknown)

    def cell_of(self, block_id: int) -> int:
        return int(block_id) // self.per_cell

    def blocks_of(self, cell: int, num_blocks: int) -> range:
        start = cell * self.per_cell
        return range(start, min(start + self.per_cell, num_blocks))


def aggregate(
    state: PoolState, per_cell: int, n_sessions: int, last_owner: np.ndarray | None = None
) -> Cells:
    """Fold blocks into cells of `per_cell` blocks (vectorised; per_cell=1 is a fast path).

    `last_owner[b]` (optional) is the session that last held block b; cached blocks have no
    owner in the snapshot, so the map remembers who produced them to tint them.
    """
    k = max(1, int(per_cell))
    n = state.num_blocks
    if last_owner is None:
        last_owner = np.full(n, -1, dtype=np.int32)
    used_b = state.used_mask()
    cached_b = state.category == CACHED
    shared_b = state.category == SHARED
    if k == 1:
        return Cells(
            per_cell=1,
            count=n,
            present=np.ones(n, dtype=np.int32),
            used=used_b.astype(np.int32),
            cached=cached_b.astype(np.int32),
            shared=shared_b.astype(np.int32),
            used_slots=np.where(used_b, state.fill, 0).astype(np.int32),
            max_ref=state.refcount.copy(),
            dominant=state.primary.copy(),
            second=state.secondary.copy(),
            last_owner=np.where(cached_b, last_owner, -1).astype(np.int32),
        )
    count = -(-n // k)
    pad = count * k - n

    def folded(a: np.ndarray, fill_value: int | bool = 0) -> np.ndarray:
        if pad:
            a = np.concatenate([a, np.full(pad, fill_value, dtype=a.dtype)])
        return a.reshape(count, k)

    present = folded(np.ones(n, dtype=np.int32)).sum(axis=1)
    used = folded(used_b).sum(axis=1).astype(np.int32)
    cached = folded(cached_b).sum(axis=1).astype(np.int32)
    shared = folded(shared_b).sum(axis=1).astype(np.int32)
    used_slots = folded(np.where(used_b, state.fill, 0)).sum(axis=1).astype(np.int32)
    max_ref = folded(state.refcount).max(axis=1).astype(np.int32)
    dominant, second = _top_two(state, k, count, max(1, n_sessions))
    # any chat that last held one of the cell's cached blocks will do as its tint
    cached_owner = folded(np.where(cached_b, last_owner, -1).astype(np.int32), -1).max(axis=1)
    return Cells(
        per_cell=k,
        count=count,
        present=present.astype(np.int32),
        used=used,
        cached=cached,
        shared=shared,
        used_slots=used_slots,
        max_ref=max_ref,
        dominant=dominant,
        second=second,
        last_owner=np.where(used == 0, cached_owner, -1).astype(np.int32),
    )


def _top_two(state: PoolState, k: int, count: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    return _top_two_of(state.primary, state.secondary, k, count, s)


def _top_two_of(
    primary: np.ndarray, secondary: np.ndarray, k: int, count: int, s: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per cell, the two sessions named most often in `primary`/`secondary` (-1 if none)."""
    cell = np.arange(primary.shape[0], dtype=np.int64) // k
    keys = []
    for owners in (primary, secondary):
        ok = owners >= 0
        keys.append(cell[ok] * s + owners[ok])
    counts = np.bincount(np.concatenate(keys), minlength=count * s).reshape(count, s)
    first = counts.argmax(axis=1).astype(np.int32)
    has_first = counts[np.arange(count), first] > 0
    counts[np.arange(count), first] = 0
    second = counts.argmax(axis=1).astype(np.int32)
    has_second = counts[np.arange(count), second] > 0
    return np.where(has_first, first, -1), np.where(has_second, second, -1)
