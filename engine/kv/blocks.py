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

The tables themselves are in engine/kv/block_table.py, the prefix cache's hash index in
engine/kv/prefix_index.py, and the invariants the tests check in engine/kv/invariants.py.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from engine.kv.block_table import PENDING, AppendResult, BlockTable, NoFreeBlocksError, chain_hash
from engine.kv.prefix_index import PrefixIndex


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        self._fill = [0] * num_blocks
        self._tokens: list[tuple[int, ...]] = [()] * num_blocks
        self._holders: list[dict[str, int]] = [{} for _ in range(num_blocks)]
        self._owners: list[tuple[str, ...]] = [()] * num_blocks
        #: Per owner (session id): [blocks held, of those shared, empty slots in them], kept
        #: as blocks change hands and fill up, so a snapshot reads a chat's numbers instead of
        #: walking its blocks (docs/ARCHITECTURE.md §3.8).
        self._usage: dict[str, list[int]] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.prefix_index = PrefixIndex(num_blocks)  # named and pending full blocks, by hash
        self._unresolved: set[int] = set()  # blocks holding a PENDING token
        self.prefix_hits = 0  # full blocks reused from the cache
        self.prefix_queries = 0  # full prompt blocks looked up
        #: The disk tier's logs (kept only while ``disk_log`` is on, engine/runner/disk_sync.py
        #: drains them between steps): blocks named in the cache, (block, hash), to be
        #: written in the background; cached blocks evicted for other content, (block, hash,
        #: tokens), whose K/V must be copied off before the step overwrites them.
        self.disk_log = False
        self.named_log: deque[tuple[int, int]] = deque()
        self.evicted: list[tuple[int, int, tuple[int, ...]]] = []
        #: Blocks of incognito (private) tables back in the free list, to be zeroed in the
        #: pool before anything reads them again.
        self.to_zero: list[int] = []
        #: Chats kept warm (``pin``): the hashes of their blocks, by key, and all of them;
        #: eviction passes over these while any other cached block is evictable.
        self._pins: dict[str, frozenset[int]] = {}
        self.pinned: frozenset[int] = frozenset()
        #: Cached blocks a chat put to sleep or deleted asked to drop while a request still
        #: held them (that chat's own last step, or a request sharing its prefix such as the
        #: app's title request): they leave the pool when their last holder releases them,
        #: unless a new prompt takes them first (``reuse_prefix``: someone wants them again).
        self.drop_when_released: set[int] = set()

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
            h = chain_hash(parent, chunk)
            block = self.prefix_index.block_for(h)
            if block is None or self._tokens[block] != chunk:
                break
            self._evictable.pop(block, None)
            self.drop_when_released.discard(block)  # wanted again: it stays cached
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

    def adopt(self, h: int, tokens: Sequence[int]) -> int | None:
        """A full block read back from the disk tier becomes a cached, evictable block
        named ``h`` (a prompt then reuses it as any cached block). Returns the block, whose
        K/V the caller writes before the next step; None when the content is in the pool
        already or no block is available. May evict the least recently used cached block
        (logged in ``evicted``)."""
        if len(tokens) != self.block_size:
            raise ValueError("only full blocks are adopted")
        if self.prefix_index.block_for(h) is not None or not self.num_available:
            return None
        block = self._take_block()
        self._tokens[block] = tuple(tokens)
        self._fill[block] = self.block_size
        self.prefix_index.name(block, h)
        self._evictable[block] = None
        return block

    def drop_cached(self, h: int, when_released: bool = False) -> int | None:
        """Forget the cached block named ``h`` (a chat put to sleep or deleted): back to the
        free list if no table holds it; otherwise, with ``when_released``, as soon as the
        last table holding it lets go (``drop_when_released``). Returns the block freed now,
        or None."""
        block = self.prefix_index.block_for(h)
        if block is None:
            return None
        if self._refcount[block]:
            if when_released:
                self.drop_when_released.add(block)
            return None
        del self._evictable[block]
        self._forget_block(block)
        return block

    def _forget_block(self, block: int) -> None:
        """An unheld cached block leaves the prefix cache for the free list."""
        self.prefix_index.drop(block)
        self._tokens[block] = ()
        self._fill[block] = 0
        self._free.append(block)

    def pin(self, key: str, hashes: Sequence[int] | None) -> None:
        """Keep the cached blocks named ``hashes`` in the pool (a chat kept warm), replacing
        what ``key`` pinned before; None unpins. Best effort: when every evictable block is
        pinned, the least recently used is evicted anyway (a pin never makes the pool fail)."""
        if hashes is None:
            self._pins.pop(key, None)
        else:
            self._pins[key] = frozenset(hashes)
        self.pinned = frozenset().union(*self._pins.values())

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
        return self.prefix_index.is_pending(chain_hash(parent, prompt[i * bs : (i + 1) * bs]))

    # ---- growth -----------------------------------------------------------------------------

    def append(self, table: BlockTable, tokens: Sequence[int], provisional: int = 0
               ) -> AppendResult:
        """Reserve slots for ``tokens`` at the end of ``table``.

        ``provisional``: how many of the last tokens are speculative drafts, to be settled by
        :meth:`settle_drafts` before anything else is appended (no block holding one is
        hashed meanwhile). All or nothing: raises NoFreeBlocksError before changing anything
        if the pool cannot hold them.
        """
        if table.num_provisional:
            raise ValueError("the table's drafts must be settled before it grows again")
        if not 0 <= provisional <= len(tokens):
            raise ValueError(f"provisional must be in [0, {len(tokens)}], got {provisional}")
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
            # The block is this table's alone (a fresh block, or copied on write above).
            self._usage[table.owner][2] -= take
            table.tokens.extend(piece)
            pos += take
        if PENDING in piece:
            self._unresolved.add(table.blocks[-1])
        table.num_provisional = provisional
        self._hash_full_blocks(table)
        return AppendResult(slots, copies)

    def settle_drafts(self, table: BlockTable, accepted: int) -> None:
        """Keep the first ``accepted`` of ``table``'s provisional (draft) tokens and roll the
        rest back: blocks wholly past the kept tokens are freed at once (they were taken for
        the drafts: private, unnamed), the partial last block is kept and its stale slots are
        overwritten by later tokens. Then the newly full blocks are hashed, and named in the
        prefix cache when their K/V has been computed (the step ran)."""
        k = table.num_provisional
        if not 0 <= accepted <= k:
            raise ValueError(f"accepted must be in [0, {k}], got {accepted}")
        keep = table.num_tokens - k + accepted
        bs = self.block_size
        needed = -(-keep // bs)
        for block in reversed(table.blocks[needed:]):
            self._release(block, table.owner)
            if table.private and not self._refcount[block]:
                self.to_zero.append(block)  # an incognito chat's rejected drafts
        del table.blocks[needed:]
        if keep % bs and table.blocks:
            block = table.blocks[-1]
            fill = keep % bs
            self._usage[table.owner][2] += self._fill[block] - fill
            self._tokens[block] = self._tokens[block][:fill]
            self._fill[block] = fill
        del table.tokens[keep:]
        table.num_computed = min(table.num_computed, keep)
        table.num_provisional = 0
        self._hash_full_blocks(table)
        self._name_computed(table, min(len(table.hashes), table.num_computed // bs))

    def resolve_pending(self, table: BlockTable, token: int) -> None:
        """The value of ``table``'s last token, reserved as PENDING, is now known."""
        if not table.tokens or table.tokens[-1] != PENDING:
            raise ValueError("the table's last token is not pending")
        table.tokens[-1] = token
        block = table.blocks[-1]
        self._tokens[block] = self._tokens[block][:-1] + (token,)
        self._unresolved.discard(block)
        self._hash_full_blocks(table)

    def _hash_full_blocks(self, table: BlockTable) -> None:
        """Chain-hash every newly full block whose tokens are all known."""
        bs = self.block_size
        parent = table.hashes[-1] if table.hashes else None
        for i in range(len(table.hashes), (table.num_tokens - table.num_provisional) // bs):
            chunk = table.tokens[i * bs : (i + 1) * bs]
            if PENDING in chunk:
                break
            parent = chain_hash(parent, chunk)
            table.hashes.append(parent)
            if table.private:  # never offered: nobody waits for it, nobody reuses it
                table.num_offered_to_cache = len(table.hashes)
            else:
                self.prefix_index.pend(parent)

    def mark_computed(self, table: BlockTable) -> None:
        """Record that every reserved slot of ``table`` now holds its K/V, and name each newly
        full block in the prefix cache."""
        table.num_computed = table.num_tokens
        self._name_computed(table, len(table.hashes))

    def _name_computed(self, table: BlockTable, upto: int) -> None:
        """Name ``table``'s hashed blocks before ``upto`` (their K/V computed) in the prefix
        cache, and log them for the disk tier."""
        for i in range(table.num_offered_to_cache, upto):
            h = table.hashes[i]
            self.prefix_index.unpend(h)
            # A block with the same content may already be cached (two chats computed the
            # same prefix at once): that one stays named; this one stays private.
            if self.prefix_index.name(table.blocks[i], h) and self.disk_log:
                self.named_log.append((table.blocks[i], h))
        table.num_offered_to_cache = max(table.num_offered_to_cache, upto)

    # ---- sharing ----------------------------------------------------------------------------

    def fork(self, table: BlockTable, owner: str | None = None) -> BlockTable:
        """A new table sharing every block of ``table`` (refcount + 1 each)."""
        if table.num_provisional:
            raise ValueError("a table holding drafts cannot be forked before they are settled")
        child = BlockTable(
            owner=table.owner if owner is None else owner,
            blocks=list(table.blocks),
            tokens=list(table.tokens),
            num_computed=table.num_computed,
            hashes=list(table.hashes),
            num_offered_to_cache=table.num_offered_to_cache,
            private=table.private,
        )
        for h in child.hashes[child.num_offered_to_cache :]:
            self.prefix_index.pend(h)
        for block in child.blocks:
            self._hold(block, child.owner)
        return child

    def free(self, table: BlockTable) -> None:
        """Release every block of ``table``; cached (hashed) blocks stay reusable in the LRU."""
        for h in table.hashes[table.num_offered_to_cache :]:
            self.prefix_index.unpend(h)
        for block in reversed(table.blocks):
            self._release(block, table.owner)
            if table.private and not self._refcount[block]:
                self.to_zero.append(block)
        table.blocks.clear()
        table.tokens.clear()
        table.num_computed = 0
        table.hashes.clear()
        table.num_offered_to_cache = 0
        table.num_provisional = 0

    # ---- introspection (snapshots, tests) ---------------------------------------------------

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def fill(self, block: int) -> int:
        return self._fill[block]

    def is_cached(self, block: int) -> bool:
        return self.prefix_index.is_named(block)

    def block_tokens(self, block: int) -> tuple[int, ...]:
        return self._tokens[block]

    def block_state(self) -> tuple[tuple, tuple, tuple, tuple, tuple]:
        """Per-block owners, refcounts, fills, cached flags and tokens, as tuples.

        Every list behind them is kept up to date by the operations that change a block, so
        this is five C-level copies (about 10 us each at 16k blocks), never a Python loop
        over the pool: only the few blocks holding a PENDING token are rewritten, so the
        snapshot never shows a token that is not known yet."""
        tokens = self._tokens
        if self._unresolved:
            tokens = list(tokens)
            for b in self._unresolved:
                tokens[b] = tuple(t for t in tokens[b] if t != PENDING)
        return (
            tuple(self._owners),
            tuple(self._refcount),
            tuple(self._fill),
            self.prefix_index.named_flags(),
            tuple(tokens),
        )

    def owner_usage(self, owner: str) -> tuple[int, int, int]:
        """Blocks ``owner``'s tables hold (each counted once), how many of those are shared
        (refcount > 1), and their slots holding no token: kept as blocks change, read by
        the snapshot per chat."""
        usage = self._usage.get(owner)
        return (usage[0], usage[1], usage[2]) if usage is not None else (0, 0, 0)

    def owners_with_blocks(self) -> list[str]:
        """The owners holding at least one block (engine/kv/invariants.py checks them)."""
        return list(self._usage)

    def free_and_evictable(self) -> tuple[list[int], list[int]]:
        """The free list and the evictable LRU, oldest first (engine/kv/invariants.py)."""
        return list(self._free), list(self._evictable)

    # ---- internals --------------------------------------------------------------------------

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block = self._victim()
            if self.disk_log:
                self.evicted.append((block, self.prefix_index.hash_of(block),
                                     self._tokens[block]))
            self.prefix_index.drop(block)
        else:
            raise NoFreeBlocksError("the KV pool is full")
        self._tokens[block] = ()
        self._fill[block] = 0
        return block

    def _victim(self) -> int:
        """The least recently used evictable block that no pin keeps; the least recently
        used of all when every one is pinned. Taken out of the LRU."""
        if self.pinned:
            hash_of = self.prefix_index.hash_of
            for block in self._evictable:
                if hash_of(block) not in self.pinned:
                    del self._evictable[block]
                    return block
        block, _ = self._evictable.popitem(last=False)
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
        refs = self._refcount[block] = self._refcount[block] + 1
        holders = self._holders[block]
        held = holders.get(owner, 0)
        holders[owner] = held + 1
        usage = self._usage
        if not held:  # a new owner of this block
            self._owners[block] = tuple(holders)
            mine = usage.get(owner)
            if mine is None:
                mine = usage[owner] = [0, 0, 0]
            mine[0] += 1
            mine[2] += self.block_size - self._fill[block]
            if refs > 2:  # already shared: shared for the newcomer too
                mine[1] += 1
        if refs == 2:  # it just became shared, for every owner (the newcomer included)
            for o in holders:
                usage[o][1] += 1

    def _release(self, block: int, owner: str) -> None:
        refs = self._refcount[block] = self._refcount[block] - 1
        holders = self._holders[block]
        usage = self._usage
        if refs == 1:  # no longer shared, for every owner (the leaving one included)
            for o in holders:
                usage[o][1] -= 1
        holders[owner] -= 1
        if not holders[owner]:
            del holders[owner]
            self._owners[block] = tuple(holders)
            mine = usage[owner]
            mine[0] -= 1
            mine[2] -= self.block_size - self._fill[block]
            if refs > 1:  # still shared by others: no longer counted for this owner
                mine[1] -= 1
            if not mine[0]:
                del usage[owner]
        if refs == 0:
            if block in self.drop_when_released:
                self.drop_when_released.discard(block)
                self._forget_block(block)
            elif self.prefix_index.is_named(block):
                self._evictable[block] = None  # most recently used at the end
            else:
                self._tokens[block] = ()
                self._fill[block] = 0
                self._unresolved.discard(block)
                self._free.append(block)
