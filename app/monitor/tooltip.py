"""Tooltip text for a block (or a cell of several blocks) of the map.

Built only when the user hovers, because decoding a block's tokens goes through the tokenizer
(`Engine.decode`); everything else comes from the snapshot the map drew.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Callable

from app.monitor.pool_state import CACHED, CATEGORY_NAMES, FREE, Cells, PoolState

MAX_TEXT = 160

_DESCRIPTION = {
    "free": "free",
    "cached": "cached prefix block: no sequence holds it; a prompt with the same prefix "
    "reuses it, otherwise it is evicted when the pool runs out",
    "held": "held by one sequence",
    "shared": "shared (copy-on-write: written only after a private copy)",
}


def visible_text(text: str, limit: int = MAX_TEXT) -> str:
    """Show whitespace so a block of spaces or newlines is still visible, and cut it short."""
    shown = text.replace("\n", "⏎").replace("\t", "⇥")
    if len(shown) > limit:
        shown = shown[: limit - 1] + "…"
    return shown


def block_tooltip(
    state: PoolState,
    block_id: int,
    name: Callable[[str], str],
    decode: Callable[[tuple[int, ...]], str] | None,
) -> str:
    """Rich text naming the block, its owners, refcount, fill, hash state and its text."""
    b = state.block(block_id)
    rows = [f"<b>Block {b.block_id}</b> · {html.escape(_DESCRIPTION[b.category])}"]
    if b.owners:
        owners = ", ".join(html.escape(name(o)) for o in b.owners)
        label = "Owner" if len(b.owners) == 1 else "Owners"
        rows.append(f"{label}: {owners}")
    rows.append(f"Refcount: {b.refcount}")
    rows.append(f"Filled: {b.fill} / {b.block_size} slots")
    rows.append(
        "Hash: cached prefix block (full, hashed, reusable)"
        if b.cached
        else "Hash: none (not a cached prefix block)"
    )
    tokens = state.snapshot.block_tokens[b.block_id] if b.category != "free" else ()
    if tokens and decode is not None:
        try:
            text = decode(tuple(tokens))
        except Exception as exc:  # a tooltip must never break hovering
            text = f"(could not decode: {exc})"
        rows.append(f"Text: “{html.escape(visible_text(text))}”")
    return "<br>".join(rows)


def cell_tooltip(state: PoolState, cells: Cells, cell: int, name: Callable[[str], str]) -> str:
    """Summary of a cell that folds several blocks: the categories and the chats inside."""
    blocks = cells.blocks_of(cell, state.num_blocks)
    cats = Counter(int(state.category[b]) for b in blocks)
    owners: Counter[str] = Counter()
    for b in blocks:
        owners.update(state.owner_sets[int(state.owner_code[b])])
    rows = [f"<b>Blocks {blocks.start}–{blocks.stop - 1}</b> ({len(blocks)} blocks in this cell)"]
    parts = [
        f"{cats[c]} {CATEGORY_NAMES[c]}"
        for c in (3, 2, CACHED, FREE)
        if cats.get(c)
    ]
    rows.append(", ".join(parts))
    if owners:
        rows.append(
            "Held by: "
            + ", ".join(f"{html.escape(name(o))} ({n})" for o, n in owners.most_common(4))
        )
    if int(cells.max_ref[cell]) > 1:
        rows.append(f"Highest refcount: {int(cells.max_ref[cell])}")
    rows.append("Zoom in (Ctrl + wheel) to see single blocks.")
    return "<br>".join(rows)
