"""Admission's look at the disk tier: a prompt whose next blocks are on disk waits for them.

The scheduler admits a prompt after reusing what the prefix cache holds of it; with the disk
tier on (docs/ARCHITECTURE.md §3.14), the chain of full prompt blocks may go on on disk.
This module is that one question and what follows from it, kept out of the scheduler's
planning: the lookup (hashes and a set lookup, once per admission; a preemption looks
again), the hand-off to the reader thread, and the sequence's state while the reader works
(``Sequence.disk_lookup``: "" not looked up, "reading", "done"). The engine thread's side of
the tier, which writes the answers into the pool, is engine/runner/disk_sync.py.

Pure bookkeeping: no MLX, no file access here (``DiskTier.read`` only queues the read).
"""

from __future__ import annotations

from engine.kv.block_table import BlockTable
from engine.kv.blocks import BlockAllocator
from engine.kv.disk_tier import DiskTier
from engine.sched.sequence import Sequence


class DiskAdmission:
    def __init__(self, alloc: BlockAllocator) -> None:
        self.alloc = alloc
        #: The disk tier (engine/kv/disk_tier.py), set by the engine thread's side of it
        #: (engine/runner/disk_sync.py ``DiskSync``); None: no lookups.
        self.tier: DiskTier | None = None

    @staticmethod
    def reading(seq: Sequence) -> bool:
        """``seq`` waits for the reader thread (it cannot be admitted yet)."""
        return seq.disk_lookup == "reading"

    def read_back(self, seq: Sequence, table: BlockTable) -> bool:
        """Ask the disk tier for the run of full prompt blocks on disk that follows
        ``table``'s reused prefix; True when ``seq`` now waits for the reader. Looked up
        once per admission (a preemption looks again): hashes and a set lookup."""
        if self.tier is None or seq.disk_lookup:
            return False
        seq.disk_lookup = "done"
        hashes, chunks = self.tier.run_on_disk(table.hashes, seq.tokens, self.alloc.block_size)
        if not hashes:
            return False
        seq.disk_lookup = "reading"
        self.tier.read(seq.seq_id, hashes, chunks)
        return True

    def read_done(self, seq: Sequence | None) -> None:
        """The reader answered for ``seq`` (its blocks, if any, are in the prefix cache
        now): it is admitted as usual, and not looked up on disk again."""
        if seq is not None and self.reading(seq):
            seq.disk_lookup = "done"
            seq.waiting_reason = ""

    @staticmethod
    def look_again(seq: Sequence) -> None:
        """``seq`` was preempted: its blocks may have gone to disk by the time it returns."""
        seq.disk_lookup = ""
