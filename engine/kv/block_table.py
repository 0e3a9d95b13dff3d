"""One sequence's view of the pool: its block ids and the tokens whose slots it holds.

The allocator (engine/kv/blocks.py) owns the blocks; a ``BlockTable`` is what a sequence,
the scheduler and the model adapter carry around. Kept in a module of its own so that the
code that only *reads* tables (sequences, the step) needs none of the allocator.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

#: A token whose slot is reserved while its value is still being computed (an overlapped
#: step feeds the previous step's sampled token before the host has read it). A block
#: holding one is not hashed until ``BlockAllocator.resolve_pending`` fills it in.
PENDING = -1


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
    #: An incognito chat's table: its blocks are never named in the prefix cache (no other
    #: chat can reuse them, none reaches the disk tier) and are zeroed when released.
    private: bool = False
    #: Trailing tokens that are speculative drafts (engine/sched/speculation.py): their slots
    #: hold K/V once the step runs, but they are not the sequence's tokens until verified, so
    #: no block holding one is hashed; ``BlockAllocator.settle_drafts`` keeps the accepted
    #: ones and rolls the rest back.
    num_provisional: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class AppendResult:
    """Where the appended tokens' K/V go, and the block copies to run first (copy-on-write)."""

    slots: list[tuple[int, int]]  # (block id, offset in block), one per appended token
    copies: list[tuple[int, int]]  # (src block, dst block)


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """A full block's name in the prefix cache: its tokens and, through the parent's hash,
    every token before it (two blocks with the same tokens after different prefixes differ).

    A 64-bit BLAKE2b digest, not Python's ``hash``: the same in every process (``hash(None)``
    is an address in Python 3.11), so it also names the block's file in the disk tier
    (engine/kv/disk_tier.py) after a restart. About 1.6 us a block."""
    h = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8)
    h.update(b"root" if parent is None else parent.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")
