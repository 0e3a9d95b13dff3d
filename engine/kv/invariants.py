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
    full = [b for b in range(alloc.num_blocks) if alloc.fill(b) == bs]
    alloc.prefix_index.check_invariants(pending, full)
