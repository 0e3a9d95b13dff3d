"""One sequence's share of a step: the one record the scheduler hands to the model adapter.

Kept free of MLX and of the allocator so the scheduler (pure bookkeeping) and the model
adapter (pure MLX) can both speak it without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SequenceWork:
    """Tokens to feed, the slots their K/V go to, and whether the step samples after them.

    ``seq`` is the engine's sequence the work belongs to (None for callers that drive the
    model adapter directly, like the load-time check); the adapter never reads it.
    """

    tokens: Sequence[int]
    start: int  # position of tokens[0] in the sequence
    blocks: Sequence[int]  # the sequence's block table, covering start + len(tokens)
    slots: Sequence[tuple[int, int]]  # (block, offset) for each fed token
    want_logits: bool = True
    seq: Any = None
    #: Speculative drafts fed after the sequence's last token (engine/sched/speculation.py):
    #: ``tokens`` ends with them, and every one of the work's rows is sampled to verify them.
    drafts: tuple[int, ...] = ()

    @property
    def num_logits(self) -> int:
        """Rows of logits the work needs: one per fed token when it verifies drafts (the
        last token's and each draft's), else one (or none: a prompt chunk before its end)."""
        if not self.want_logits:
            return 0
        return len(self.drafts) + 1
