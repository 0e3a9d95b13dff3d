"""The engine thread's side of the disk tier: blocks copied off the pool, and read back in.

The disk tier's threads (engine/kv/disk_tier.py) never touch MLX; this module is where the
engine thread moves K/V between the pool and host memory, at three points of its loop
(docs/ARCHITECTURE.md §3.14):

* **after scheduling, before the step writes** (:meth:`DiskSync.save_evicted`): cached
  blocks the scheduler just evicted for other content are copied off while they still hold
  their K/V, unless their file is on disk already;
* **between steps** (:meth:`DiskSync.write_through`): blocks newly named in the prefix cache
  are copied off a few at a time (``STEP_WRITE_BYTES`` a step, so no step waits long), all
  of them while the engine is idle and before it stops (:meth:`DiskSync.close`), so an open
  chat's blocks are on disk before the app quits;
* **before scheduling** (:meth:`DiskSync.restore`): prompts the reader thread has answered
  get their blocks adopted into the prefix cache (engine/kv/blocks.py ``adopt``) and their
  K/V written into the pool (a few blocks a step while other chats are stepping); the
  scheduler then admits them as prompts whose prefix is cached, and prefills only the rest.

Copying off is one gather per call (``KVPool.read_blocks``: every layer's rows stacked and
evaluated, then one numpy copy); the files are written by the writer thread.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.events import ContextResidency
from engine.kv.block_table import chain_hash
from engine.kv.blocks import BlockAllocator
from engine.kv.disk_tier import DiskTier, ReadResult, WriteBatch
from engine.kv.pool import KVPool
from engine.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

#: Bytes of blocks a step copies off for the background writer at most (the evicted blocks
#: it must save are not counted: they cannot wait). About 5 blocks of the default model's
#: fp32 pool; measured in bench/disk_resume.py (step-time p99 with the writer busy).
STEP_WRITE_BYTES = 4 * 2**20
#: Bytes of blocks read back from disk that a step writes into the pool at most while other
#: chats are stepping (about 11 blocks of the default model's fp32 pool, ~1 ms each on the
#: CPU); a restore with nothing else running takes everything at once.
STEP_RESTORE_BYTES = 8 * 2**20
#: Blocks copied per call while the engine is idle (it checks its inbox between calls).
IDLE_WRITE_BLOCKS = 64


@dataclass
class _Restore:
    """A reader's answer being written into the pool, a few blocks a step."""

    result: ReadResult
    next: int = 0  # the first of its blocks not adopted yet


class DiskSync:
    def __init__(self, tier: DiskTier, pool: KVPool, alloc: BlockAllocator,
                 scheduler: Scheduler) -> None:
        self.tier = tier
        self.pool = pool
        self.alloc = alloc
        self.scheduler = scheduler
        self._restoring: deque[_Restore] = deque()
        alloc.disk_log = True
        scheduler.disk.tier = tier

    @property
    def pending_writes(self) -> bool:
        """Named blocks not yet offered to the writer, and room to offer them."""
        return bool(self.alloc.named_log) and self.tier.writable and self.tier.has_room

    def save_evicted(self) -> None:
        """Copy off the cached blocks evicted since the last call (before anything writes
        into them) that are not on disk yet. With the writer's queue full they are dropped
        (recomputed when needed): a slow disk never makes the engine hold more copies."""
        evicted, self.alloc.evicted = self.alloc.evicted, []
        if evicted and self.tier.has_room:
            self._save([(b, h, t) for b, h, t in evicted if self.tier.wants(h)])

    def write_through(self, max_blocks: int | None = None, wait: bool = False) -> None:
        """Copy off blocks named since the last call, oldest first: ``max_blocks`` of them,
        or (None) as many as ``STEP_WRITE_BYTES`` allows; none while the writer's queue is
        full (they stay in the log for a later call) unless ``wait`` (the engine stops:
        everything goes)."""
        if max_blocks is None:
            max_blocks = max(1, STEP_WRITE_BYTES // self.pool.bytes_per_block)
        log = self.alloc.named_log
        index = self.alloc.prefix_index
        todo: list[tuple[int, int, tuple[int, ...]]] = []
        while log and len(todo) < max_blocks and (wait or self.tier.has_room):
            block, h = log.popleft()
            # Still that content (not evicted and reused since), not on disk yet, and not
            # leaving (put to sleep: saved already; deleted: must not come back).
            if (index.block_for(h) == block and self.tier.wants(h)
                    and block not in self.alloc.drop_when_released):
                todo.append((block, h, self.alloc.block_tokens(block)))
        self._save(todo)

    def save_cached(self, hashes: Sequence[int]) -> None:
        """Copy off the blocks of ``hashes`` that are in the prefix cache and not on disk
        yet, now, whatever the writer's queue holds. Public for a conversation put to sleep
        (:func:`put_to_sleep`): its blocks are about to leave the pool, so they are saved
        first, outside the step's rhythm and its ``STEP_WRITE_BYTES``."""
        todo = []
        for h in hashes:
            block = self.alloc.prefix_index.block_for(h)
            if block is not None and self.tier.wants(h):
                todo.append((block, h, self.alloc.block_tokens(block)))
        self._save(todo)

    def _save(self, todo: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """One gather of ``todo``'s blocks (block, chain hash, tokens) for the writer."""
        if not todo:
            return
        arrays = self.pool.read_blocks([b for b, _, _ in todo])
        self.tier.write(WriteBatch(arrays, [(j, h, t) for j, (_, h, t) in enumerate(todo)],
                                   sum(a.nbytes for a in arrays)))

    @property
    def restoring(self) -> bool:
        """A read-back answer is half written into the pool (other chats were stepping)."""
        return bool(self._restoring)

    def restore(self) -> None:
        """Adopt the blocks the reader has brought back, write their K/V into the pool, and
        let their sequences be admitted. While other chats are stepping, at most
        ``STEP_RESTORE_BYTES`` a call (a long chat's read-back spreads over a few steps
        instead of stalling them); all at once when nothing else runs."""
        while (result := self.tier.take_read()) is not None:
            self._restoring.append(_Restore(result))
        budget = None
        if self.scheduler.running:
            budget = max(1, STEP_RESTORE_BYTES // self.pool.bytes_per_block)
        while self._restoring and (budget is None or budget > 0):
            job = self._restoring[0]
            end = len(job.result.hashes) if budget is None else min(
                len(job.result.hashes), job.next + budget)
            written = self._restore_columns(job, end)
            if budget is not None:
                budget -= max(1, written)
            if job.next < len(job.result.hashes):
                continue  # more of this answer next call (or the pool was full: stopped)
            self._restoring.popleft()
            self.scheduler.disk_read_done(job.result.key)

    def _restore_columns(self, job: _Restore, end: int) -> int:
        """Adopt and write the answer's blocks ``job.next:end``; returns how many were
        written. When the pool has no room, the rest of the answer is dropped (recomputed)."""
        result = job.result
        blocks, columns = [], []
        # Adopted blocks join the LRU's newest end: at most as many as are available now,
        # so that adopting never evicts a block adopted a moment before.
        room = self.alloc.num_available
        j = job.next
        while j < end:
            if len(blocks) >= room:
                j = len(result.hashes)  # the pool is full: the rest is recomputed
                break
            block = self.alloc.adopt(result.hashes[j], result.tokens[j])
            if block is None and self.alloc.prefix_index.block_for(result.hashes[j]) is None:
                j = len(result.hashes)  # the pool is full: the rest is recomputed
                break
            if block is not None:  # (None: in the pool already, another chat computed it)
                blocks.append(block)
                columns.append(j)
            j += 1
        job.next = j
        self.save_evicted()  # adopting may have evicted blocks: copied off first
        if blocks:
            whole = columns == list(range(len(result.hashes)))
            parts = result.arrays if whole else [a[:, columns] for a in result.arrays]
            self.pool.write_blocks(blocks, parts)
            self.tier.count_hits(len(blocks))
            seq = self.scheduler.waiting.get(result.key)
            if seq is not None:
                seq.request.disk_prompt_tokens += len(blocks) * self.alloc.block_size
        return len(blocks)

    def close(self) -> None:
        """Before the engine stops: every named block not on disk yet is copied off, and the
        writer finishes (an open chat continues after a restart)."""
        self.restore()
        while self.alloc.named_log and self.tier.writable:
            self.write_through(IDLE_WRITE_BLOCKS, wait=True)
        self.tier.close()


def full_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chain hashes of ``tokens``' full blocks that a prompt could take from a cache (the
    last token is always computed, as ``BlockAllocator.reuse_prefix`` does)."""
    hashes: list[int] = []
    parent = None
    for i in range((len(tokens) - 1) // block_size):
        parent = chain_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def residency(alloc: BlockAllocator, tier: DiskTier | None, tokens: Sequence[int]
              ) -> ContextResidency:
    """Where ``tokens``' context is: hashing and lookups only (any thread: a dict and a set
    read, never MLX), so the app can ask for every open chat."""
    hashes = full_block_hashes(tokens, alloc.block_size)
    memory = 0
    while memory < len(hashes) and alloc.prefix_index.block_for(hashes[memory]) is not None:
        memory += 1
    disk = 0
    if tier is not None:
        while memory + disk < len(hashes) and tier.has(hashes[memory + disk]):
            disk += 1
    return ContextResidency(len(hashes), memory, disk)


def put_to_sleep(sync: DiskSync | None, alloc: BlockAllocator, tokens: Sequence[int]) -> None:
    """Release a conversation's cached blocks from the pool (engine thread): with the disk
    tier on they are written first, so it is read back later instead of recomputed. Blocks a
    request still holds (the chat's own last step, a request sharing its prefix such as the
    app's title request) leave when it releases them."""
    hashes = full_block_hashes(tokens, alloc.block_size)
    if sync is not None:
        sync.save_cached(hashes)
    for h in hashes:
        alloc.drop_cached(h, when_released=True)


def forget(sync: DiskSync | None, alloc: BlockAllocator, tokens: Sequence[int],
           keep: Sequence[Sequence[int]] = ()) -> None:
    """Delete a conversation's blocks that none of ``keep`` (the other chats) shares: from
    the pool's cache (those a running request holds when it releases them) and from the disk
    tier."""
    kept: set[int] = set()
    for other in keep:
        kept.update(full_block_hashes(other, alloc.block_size))
    mine = [h for h in full_block_hashes(tokens, alloc.block_size) if h not in kept]
    for h in mine:
        alloc.drop_cached(h, when_released=True)
    if sync is not None:
        sync.tier.delete(mine)
