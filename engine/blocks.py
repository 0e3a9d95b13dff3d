"""The block allocator: who holds which KV block, and which blocks can be reused.

Pure bookkeeping (no MLX): the pool's memory never moves; this module decides which slots a
token's K/V goes to. Three things make the pool go further than one rectangle per chat:

* **paging**: a sequence holds whole blocks only as it grows, so at most one partial block per
  sequence is wasted;
* **prefix cache**: every *full, computed* block is named by a hash chained from its parent's
  hash and its token ids, so a later prompt with the same prefix reuses those blocks instead
  of recomputing them. Unreferenced cached blocks wait in an LRU and are evicted only when the
  free list is empty; a block's hash is dropped when the block is reused for other content;
* **fork / copy-on-write**: a forked sequence shares all its parent's blocks; the first write
  into a shared partial block copies it first (the copy itself is the pool's job: the
  allocator returns the (src, dst) pairs).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class NoFreeBlocksError(RuntimeError):
    """The pool has no free or evictable block left (the scheduler preempts on this)."""


@dataclass(eq=False)
class BlockTable:
    """One sequence's blocks and the tokens whose slots it holds, in order.

    ``num_computed`` tokens have their K/V in the pool; the rest have slots reserved for the
    step that is about to run.
    """

    owner: str
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    hashes: list[int] = field(default_factory=list)  # chain hash of each full block
    num_offered_to_cache: int = 0  # leading full blocks already offered to the prefix cache

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def _chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


@dataclass(frozen=True)
class AppendResult:
    """Where the appended tokens' K/V go, and the block copies to run first (copy-on-write)."""

    slots: list[tuple[int, int]]  # (block id, offset in block), one per appended token
    copies: list[tuple[int, int]]  # (src block, dst block)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        self._fill = [0] * num_blocks
        self._tokens: list[tuple[int, ...]] = [()] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._holders: list[dict[str, int]] = [{} for _ in range(num_blocks)]
        self._owners: list[tuple[str, ...]] = [()] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}
        # Full blocks whose slots are reserved but not yet computed, by content hash: a prompt
        # that would reuse them waits one step instead of computing them a second time.
        self._pending: Counter[int] = Counter()
        self.prefix_hits = 0  # full blocks reused from the cache
        self.prefix_queries = 0  # full prompt blocks looked up

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def blocks_needed(self, table: BlockTable, n_tokens: int) -> int:
        """New blocks an append of ``n_tokens`` would take, copy-on-write included."""
        if n_tokens <= 0:
            return 0
        bs = self.block_size
        room = 0
        cow = 0
        if table.blocks and table.num_tokens % bs:
            last = table.blocks[-1]
            room = bs - table.num_tokens % bs
            cow = 1 if self._refcount[last] > 1 else 0
        beyond = max(0, n_tokens - room)
        return cow + -(-beyond // bs)

    # ---- prefix cache -----------------------------------------------------------------------

    def reuse_prefix(self, table: BlockTable, prompt: Sequence[int], count: bool = True) -> int:
        """Attach the cached blocks of the longest full-block prefix of ``prompt`` to an empty
        table and return how many prompt tokens they cover.

        The last prompt token is never taken from the cache: the model must run on at least
        one token to produce the next token's logits. ``count`` records the lookup in the
        hit-rate counters (a caller that may undo the reuse records it itself).
        """
        if table.blocks:
            raise ValueError("reuse_prefix needs an empty block table")
        bs = self.block_size
        eligible = (len(prompt) - 1) // bs
        parent: int | None = None
        for i in range(eligible):
            chunk = tuple(prompt[i * bs : (i + 1) * bs])
            h = _chain_hash(parent, chunk)
            block = self._by_hash.get(h)
            if block is None or self._tokens[block] != chunk:
                break
            self._evictable.pop(block, None)
            self._hold(block, table.owner)
            table.blocks.append(block)
            table.tokens.extend(chunk)
            table.hashes.append(h)
            parent = h
        table.num_offered_to_cache = len(table.hashes)
        table.num_computed = table.num_tokens
        if count:
            self.record_prefix_lookup(table, prompt)
        return table.num_computed

    def record_prefix_lookup(self, table: BlockTable, prompt: Sequence[int]) -> None:
        """Count a prompt's full blocks as prefix-cache queries and its reused ones as hits."""
        self.prefix_queries += (len(prompt) - 1) // self.block_size
        self.prefix_hits += len(table.blocks)

    def prefix_pending(self, table: BlockTable, prompt: Sequence[int]) -> bool:
        """True if the block that would follow ``table``'s reused prefix is being computed
        right now by another sequence (same content): waiting one step shares it."""
        bs = self.block_size
        i = len(table.hashes)
        if (i + 1) * bs > len(prompt) - 1:
            return False
        parent = table.hashes[-1] if table.hashes else None
        return _chain_hash(parent, prompt[i * bs : (i + 1) * bs]) in self._pending

    # ---- growth -----------------------------------------------------------------------------

    def append(self, table: BlockTable, tokens: Sequence[int]) -> AppendResult:
        """Reserve slots for ``tokens`` at the end of ``table``.

        All or nothing: raises NoFreeBlocksError before changing anything if the pool cannot
        hold them.
        """
        if self.blocks_needed(table, len(tokens)) > self.num_available:
            raise NoFreeBlocksError(
                f"{len(tokens)} tokens need {self.blocks_needed(table, len(tokens))} blocks, "
                f"{self.num_available} available"
            )
        bs = self.block_size
        slots: list[tuple[int, int]] = []
        copies: list[tuple[int, int]] = []
        pos = 0
        while pos < len(tokens):
            offset = table.num_tokens % bs
            if offset == 0:
                block = self._take_block()
                self._hold(block, table.owner)
                table.blocks.append(block)
            else:
                block = table.blocks[-1]
                if self._refcount[block] > 1:
                    copies.append((block, self._copy_on_write(table, block)))
                    block = table.blocks[-1]
            take = min(bs - offset, len(tokens) - pos)
            piece = tuple(tokens[pos : pos + take])
            for i in range(take):
                slots.append((block, offset + i))
            self._tokens[block] = self._tokens[block] + piece
            self._fill[block] = offset + take
            table.tokens.extend(piece)
            pos += take
        parent = table.hashes[-1] if table.hashes else None
        for i in range(len(table.hashes), table.num_tokens // bs):
            parent = _chain_hash(parent, table.tokens[i * bs : (i + 1) * bs])
            table.hashes.append(parent)
            self._pending[parent] += 1
        return AppendResult(slots, copies)

    def mark_computed(self, table: BlockTable) -> None:
        """Record that every reserved slot of ``table`` now holds its K/V, and name each newly
        full block in the prefix cache."""
        table.num_computed = table.num_tokens
        for i in range(table.num_offered_to_cache, len(table.hashes)):
            h = table.hashes[i]
            self._unpend(h)
            block = table.blocks[i]
            # A block with the same content may already be cached (two chats computed the
            # same prefix at once): keep that one named; this one stays private.
            if self._hash[block] is None and h not in self._by_hash:
                self._hash[block] = h
                self._by_hash[h] = block
        table.num_offered_to_cache = len(table.hashes)

    # ---- sharing ----------------------------------------------------------------------------

    def fork(self, table: BlockTable, owner: str | None = None) -> BlockTable:
        """A new table sharing every block of ``table`` (refcount + 1 each)."""
        child = BlockTable(
            owner=table.owner if owner is None else owner,
            blocks=list(table.blocks),
            tokens=list(table.tokens),
            num_computed=table.num_computed,
            hashes=list(table.hashes),
            num_offered_to_cache=table.num_offered_to_cache,
        )
        for h in child.hashes[child.num_offered_to_cache :]:
            self._pending[h] += 1
        for block in child.blocks:
            self._hold(block, child.owner)
        return child

    def free(self, table: BlockTable) -> None:
        """Release every block of ``table``; cached (hashed) blocks stay reusable in the LRU."""
        for h in table.hashes[table.num_offered_to_cache :]:
            self._unpend(h)
        for block in reversed(table.blocks):
            self._release(block, table.owner)
        table.blocks.clear()
        table.tokens.clear()
        table.num_computed = 0
        table.hashes.clear()
        table.num_offered_to_cache = 0

    # ---- introspection (snapshots, tests) ---------------------------------------------------

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def fill(self, block: int) -> int:
        return self._fill[block]

    def is_cached(self, block: int) -> bool:
        return self._hash[block] is not None

    def block_tokens(self, block: int) -> tuple[int, ...]:
        return self._tokens[block]

    def block_state(self) -> tuple[tuple, tuple, tuple, tuple, tuple]:
        """Per-block owners, refcounts, fills, cached flags and tokens, as tuples (cheap)."""
        return (
            tuple(self._owners),
            tuple(self._refcount),
            tuple(self._fill),
            tuple(h is not None for h in self._hash),
            tuple(self._tokens),
        )

    def check_invariants(self, tables: Iterable[BlockTable]) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent with ``tables``."""
        tables = list(tables)
        counts = [0] * self.num_blocks
        for t in tables:
            assert len(set(t.blocks)) == len(t.blocks), "a table holds a block twice"
            assert len(t.blocks) == -(-t.num_tokens // self.block_size), "table size mismatch"
            assert t.num_computed <= t.num_tokens
            for i, block in enumerate(t.blocks):
                counts[block] += 1
                expect = tuple(t.tokens[i * self.block_size : (i + 1) * self.block_size])
                assert self._tokens[block] == expect, f"block {block} content mismatch"
        assert counts == self._refcount, "refcounts differ from the tables holding blocks"
        pending: Counter[int] = Counter()
        for t in tables:
            assert len(t.hashes) == t.num_tokens // self.block_size, "missing block hashes"
            assert t.num_offered_to_cache <= len(t.hashes)
            pending.update(t.hashes[t.num_offered_to_cache :])
        assert pending == self._pending, "pending-block index differs from the tables"
        free = set(self._free)
        assert len(free) == len(self._free), "free list holds a block twice"
        evictable = set(self._evictable)
        for block in range(self.num_blocks):
            referenced = self._refcount[block] > 0
            states = (block in free) + (block in evictable) + referenced
            assert states == 1, f"block {block} is not exactly one of free/referenced/evictable"
            if block in free:
                assert self._hash[block] is None, f"free block {block} keeps a hash"
            if block in evictable:
                assert self._hash[block] is not None, f"evictable block {block} has no hash"
        hashed = [b for b in range(self.num_blocks) if self._hash[b] is not None]
        assert len({self._hash[b] for b in hashed}) == len(hashed), "two blocks share a hash"
        assert all(self._by_hash[self._hash[b]] == b for b in hashed), "hash index is stale"
        assert len(self._by_hash) == len(hashed), "hash index holds dropped blocks"
        for block in hashed:
            assert self._fill[block] == self.block_size, f"cached block {block} is not full"

    # ---- internals --------------------------------------------------------------------------

    def _unpend(self, h: int) -> None:
        self._pending[h] -= 1
        if not self._pending[h]:
            del self._pending[h]

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash[block]]
            self._hash[block] = None
        else:
            raise NoFreeBlocksError("the KV pool is full")
        self._tokens[block] = ()
        self._fill[block] = 0
        return block

    def _copy_on_write(self, table: BlockTable, shared: int) -> int:
        copy = self._take_block()
        self._tokens[copy] = self._tokens[shared]
        self._fill[copy] = self._fill[shared]
        self._release(shared, table.owner)
        self._hold(copy, table.owner)
        table.blocks[-1] = copy
        return copy

    def _hold(self, block: int, owner: str) -> None:
        self._refcount[block] += 1
        holders = self._holders[block]
        holders[owner] = holders.get(owner, 0) + 1
        if holders[owner] == 1:
            self._owners[block] = tuple(holders)

    def _release(self, block: int, owner: str) -> None:
        self._refcount[block] -= 1
        holders = self._holders[block]
        holders[owner] -= 1
        if not holders[owner]:
            del holders[owner]
            self._owners[block] = tuple(holders)
        if self._refcount[block] == 0:
            if self._hash[block] is not None:
                self._evictable[block] = None  # most recently used at the end
            else:
                self._tokens[block] = ()
                self._fill[block] = 0
                self._free.append(block)
