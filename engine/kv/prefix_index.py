"""The prefix cache's index: which block holds the K/V of which full-block prefix.

Two maps, both keyed by a block's chain hash (engine/kv/block_table.py ``chain_hash``):

* *named* blocks: full, computed blocks whose K/V a later prompt with the same prefix may
  reuse. At most one block carries a hash, so two chats that computed the same prefix at
  once keep one named copy and the other stays private;
* *pending* hashes: full blocks whose slots are reserved but whose K/V a running step is
  still computing. A prompt that would reuse one waits a step instead of computing it twice.

Kept apart from the allocator's free list and refcounts (engine/kv/blocks.py) because it
answers a different question, "is this content already in the pool?", and has invariants
of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class PrefixIndex:
    def __init__(self, num_blocks: int) -> None:
        self._hash: list[int | None] = [None] * num_blocks
        self._named: list[bool] = [False] * num_blocks  # kept with _hash: the snapshot's flags
        self._by_hash: dict[int, int] = {}
        self._pending: Counter[int] = Counter()

    # ---- named blocks -------------------------------------------------------------------

    def block_for(self, h: int) -> int | None:
        """The block named ``h``, if any."""
        return self._by_hash.get(h)

    def is_named(self, block: int) -> bool:
        return self._hash[block] is not None

    def hash_of(self, block: int) -> int | None:
        """``block``'s name, if it has one."""
        return self._hash[block]

    def name(self, block: int, h: int) -> bool:
        """Name ``block`` by ``h`` unless it or that content is named already; True when
        it was named now."""
        if self._hash[block] is None and h not in self._by_hash:
            self._hash[block] = h
            self._named[block] = True
            self._by_hash[h] = block
            return True
        return False

    def drop(self, block: int) -> None:
        """Forget ``block``'s name (it is being reused for other content)."""
        del self._by_hash[self._hash[block]]
        self._hash[block] = None
        self._named[block] = False

    def named_flags(self) -> tuple[bool, ...]:
        """Which blocks are named, one flag per block: a copy of a list kept as names come
        and go (a snapshot must not walk the pool in Python)."""
        return tuple(self._named)

    # ---- pending hashes -----------------------------------------------------------------

    def pend(self, h: int) -> None:
        self._pending[h] += 1

    def unpend(self, h: int) -> None:
        self._pending[h] -= 1
        if not self._pending[h]:
            del self._pending[h]

    def is_pending(self, h: int) -> bool:
        return h in self._pending

    # ---- invariants (tests) -------------------------------------------------------------

    def check_invariants(self, pending: Counter[int], full: Iterable[int]) -> None:
        """Raise AssertionError unless the pending hashes equal ``pending`` (counted from
        the tables), no two blocks share a name, the index is not stale, and every named
        block is in ``full``."""
        assert pending == self._pending, "pending-block index differs from the tables"
        hashed = [b for b, h in enumerate(self._hash) if h is not None]
        assert len({self._hash[b] for b in hashed}) == len(hashed), "two blocks share a hash"
        assert all(self._by_hash[self._hash[b]] == b for b in hashed), "hash index is stale"
        assert len(self._by_hash) == len(hashed), "hash index holds dropped blocks"
        assert self._named == [h is not None for h in self._hash], "named flags are stale"
        full = set(full)
        for block in hashed:
            assert block in full, f"cached block {block} is not full"
