"""What a sequence's table can take from the pool now, without preempting anyone.

One question asked by the scheduler's admission and prompt chunks
(engine/sched/scheduler.py) and by the slots it gives speculative drafts
(engine/sched/draft_slots.py): the room left in the table's last block plus every available
block, less the block a copy-on-write of a shared last block would take.
"""

from __future__ import annotations

from engine.kv.block_table import BlockTable
from engine.kv.blocks import BlockAllocator


def tokens_that_fit(alloc: BlockAllocator, table: BlockTable) -> int:
    """The most tokens ``table`` can take now without preempting anyone."""
    bs = alloc.block_size
    available = alloc.num_available
    room = (bs - table.num_tokens % bs) % bs
    if room and alloc.refcount(table.blocks[-1]) > 1:  # copy-on-write takes a block
        if not available:
            return 0
        available -= 1
    return room + available * bs
