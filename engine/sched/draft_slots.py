"""Pool slots for speculative drafts: how many of a sequence's drafts a step verifies, and
what becomes of their slots once verified (docs/ARCHITECTURE.md §3.13).

The drafts themselves come from the speculator (engine/sched/speculation.py, set as
:attr:`DraftSlots.drafter` by the step runner); the scheduler reserves the slots this module
grants after the decoding sequence's own token, as provisional slots of its table
(engine/kv/blocks.py ``append(provisional=...)``). Kept apart from the scheduler's planning
because its one rule is its own: drafts take only free blocks beyond one per running
sequence, so they never cause a preemption; and the slots are settled once the step
runner has read the verification (accepted drafts kept, the rest rolled back).

Pure bookkeeping on the allocator: no MLX here.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.kv.blocks import BlockAllocator
from engine.sched.room import tokens_that_fit
from engine.sched.sequence import Sequence


class DraftSlots:
    def __init__(self, alloc: BlockAllocator) -> None:
        self.alloc = alloc
        #: Proposes a decoding sequence's speculative drafts (engine/sched/speculation.py
        #: ``Speculator.propose``); None: no drafting.
        self.drafter: Callable[[Sequence], list[int]] | None = None

    def granted(self, seq: Sequence, running: int) -> list[int]:
        """The drafts a decoding sequence verifies this step: the drafter's, cut to what the
        pool holds without preempting anyone (a block kept free for each of the ``running``
        sequences: drafts never push a chat out)."""
        if self.drafter is None or seq.inflight:
            return []
        drafts = self.drafter(seq)
        if not drafts:
            return []
        bs = self.alloc.block_size
        spare = self.alloc.num_available - running - self.alloc.blocks_needed(seq.table, 1)
        room = -(seq.num_in_table + 1) % bs  # left in the block the sequence's token goes to
        fits = min(room + max(0, spare) * bs, tokens_that_fit(self.alloc, seq.table) - 1)
        return drafts[:max(0, fits)]

    def settle(self, seq: Sequence, accepted: int) -> None:
        """``seq``'s drafts were verified: the first ``accepted`` stay in its table, the
        rest are rolled back (engine/kv/blocks.py ``settle_drafts``). A finished sequence is
        left alone: its blocks go back after the step."""
        if not seq.finished and seq.table is not None and seq.table.num_provisional:
            self.alloc.settle_drafts(seq.table, accepted)
