"""The allocator's invariants, checked against the block tables that hold its blocks.

docs/ARCHITECTURE.md §3.2 states them; the property tests (tests/test_blocks.py), the
scheduler tests and the engine's no-leak checks call :func:`check_invariants` after every
operation. It reads the allocator only through its public introspection, so it checks what
the snapshots and the scheduler see, and it lives outside engine/kv/blocks.py because no
engine code path runs it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.kv.block_table import PENDING, BlockTable
from engine.kv.blocks import BlockAllocator


def check_invariants(alloc: BlockAllocator, tables: Iterable[BlockTable]) -> None:
    """Raise AssertionError if ``alloc``'s bookkeeping is inconsistent with ``tables``."""
    tables = list(tables)
    bs = alloc.block_size
    counts = [0] * alloc.num_blocks
    for t in tables:
        assert len(set(t.blocks)) == len(t.blocks), "a table holds a block twice"
        assert len(t.blocks) == -(-t.num_tokens // bs), "table size mismatch"
        assert t.num_computed <= t.num_tokens
        for i, block in enumerate(t.blocks):
            counts[block] += 1
            expect = tuple(t.tokens[i * bs : (i + 1) * bs])
            assert alloc.block_tokens(block) == expect, f"block {block} content mismatch"
    refcounts = [alloc.refcount(b) for b in range(alloc.num_blocks)]
    assert counts == refcounts, "refcounts differ from the tables holding blocks"
    pending: Counter[int] = Counter()
    for t in tables:
        known = t.tokens.index(PENDING) if PENDING in t.tokens else t.num_tokens
        known = min(known, t.num_tokens - t.num_provisional)  # drafts are never hashed
        assert len(t.hashes) == known // bs, "missing block hashes"
        assert t.num_offered_to_cache <= len(t.hashes)
        pending.update(t.hashes[t.num_offered_to_cache :])
    free_list, evictable_list = alloc.free_and_evictable()
    free, evictable = set(free_list), set(evictable_list)
    assert len(free) == len(free_list), "free list holds a block twice"
    for block in range(alloc.num_blocks):
        states = (block in free) + (block in evictable) + (refcounts[block] > 0)
        assert states == 1, f"block {block} is not exactly one of free/referenced/evictable"
        if block in free:
            assert not alloc.is_cached(block), f"free block {block} keeps a hash"
        if block in evictable:
            assert alloc.is_cached(block), f"evictable block {block} has no hash"
    for block in alloc.drop_when_released:
        assert refcounts[block] > 0 and alloc.is_cached(block), \
            f"block {block} waits to be dropped but is not a held cached block"
    full = [b for b in range(alloc.num_blocks) if alloc.fill(b) == bs]
    alloc.prefix_index.check_invariants(pending, full)
    check_snapshot_state(alloc, tables)


def check_snapshot_state(alloc: BlockAllocator, tables: Iterable[BlockTable]) -> None:
    """Raise AssertionError unless the state the allocator keeps incrementally for
    snapshots (``block_state`` and ``owner_usage``) equals a recomputation from scratch
    out of ``tables``: the owners, fills, cached flags and visible tokens of every block,
    and each owner's blocks held, shared and empty slots, summed the way the snapshot
    used to sum them, block by block."""
    tables = list(tables)
    bs = alloc.block_size
    n = alloc.num_blocks
    owners, refcounts, fills, cached, tokens = alloc.block_state()
    holders: list[dict[str, None]] = [{} for _ in range(n)]
    expect_fill = [0] * n
    expect_tokens: list[tuple[int, ...]] = [()] * n
    held: dict[str, set[int]] = {}
    for t in tables:
        for i, block in enumerate(t.blocks):
            holders[block][t.owner] = None
            content = t.tokens[i * bs : (i + 1) * bs]
            expect_fill[block] = len(content)
            expect_tokens[block] = tuple(x for x in content if x != PENDING)
            held.setdefault(t.owner, set()).add(block)
    for block in range(n):
        assert set(owners[block]) == set(holders[block]), f"block {block} owners are stale"
        assert len(owners[block]) == len(holders[block]), f"block {block} lists an owner twice"
        assert refcounts[block] == alloc.refcount(block)
        assert cached[block] == alloc.is_cached(block), f"block {block} cached flag is stale"
        if refcounts[block]:
            assert fills[block] == expect_fill[block], f"block {block} fill is stale"
            assert tokens[block] == expect_tokens[block], f"block {block} tokens are stale"
        elif cached[block]:  # evictable: full, its tokens kept for a later prompt
            assert fills[block] == bs and len(tokens[block]) == bs
        else:
            assert fills[block] == 0 and tokens[block] == (), f"free block {block} not empty"
    for owner, blocks in held.items():
        expect = (len(blocks), sum(1 for b in blocks if refcounts[b] > 1),
                  sum(bs - fills[b] for b in blocks))
        assert alloc.owner_usage(owner) == expect, f"{owner}'s usage is stale"
    assert set(alloc.owners_with_blocks()) == set(held), "an owner without blocks is kept"
