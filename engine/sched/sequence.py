"""Request and sequence state, as the engine thread sees it.

A request (one chat turn) has one sequence per sample (n > 1 forks the first one after its
prompt), or, for beam search, one per beam (engine/sched/beams.py: the beams fork and are
pruned every step). A sequence keeps its tokens even when preempted: its blocks are freed
and its tokens recomputed later, so preemption never loses output.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from engine.config import Priority, SamplingParams
from engine.events import FinishReason, SequenceState
from engine.kv.block_table import PENDING, BlockTable

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import StreamingDetokenizer

    from engine.handle import RequestHandle

_seq_ids = itertools.count()


@dataclass(eq=False)
class Request:
    request_id: str
    session_id: str
    params: SamplingParams
    prompt: list[int]
    handle: RequestHandle
    arrival: float = field(default_factory=time.perf_counter)
    sequences: list[Sequence] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    forked: bool = False
    priority: Priority = Priority.NORMAL
    #: A constrained request's grammars (engine/runner/constraints.py ``Grammars``).
    grammars: Any = None
    #: A beam search's group (engine/sched/beams.py ``BeamGroup``); None for sampling and
    #: greedy requests.
    beams: Any = None
    #: An incognito chat's request: its blocks are private (engine/kv/block_table.py), never
    #: shared, never written to disk, zeroed when released.
    incognito: bool = False
    #: Prompt tokens whose K/V were read back from the disk tier (engine/kv/disk_tier.py).
    disk_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return (len(self.sequences) == self.params.num_sequences
                and all(s.finished for s in self.sequences))


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int
    tokens: list[int]
    num_prompt: int
    key: mx.array | None  # a seeded sample's PRNG key (engine/runner/sampling.py); else None
    detokenizer: StreamingDetokenizer
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    table: BlockTable | None = None
    state: SequenceState = SequenceState.WAITING
    admitted_at: int = -1  # scheduler step counter at admission (preemption picks the latest)
    emitted_chars: int = 0
    text: str = ""
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    preemptions: int = 0
    #: The launch (StepRunner's count) whose draw left ``key`` where it is: while the same
    #: rows keep decoding their keys are carried by the steps (engine/runner/step.py) and ``key``
    #: is written back only when they stop; a step rerun late never takes a key back.
    key_from: int = 0
    #: Tokens sampled on the device and not read yet (overlapped steps): the next step may
    #: already feed the newest, as a PENDING slot (engine/kv/blocks.py). A count, not a flag:
    #: step t+1 is launched (one more) before step t's token is read (one less), and the
    #: sequence must still count t+1's token when the next step is scheduled.
    inflight: int = 0

    #: Why the scheduler left it waiting in its last step ("" when it ran): for the monitor.
    waiting_reason: str = ""
    #: The grammar's matcher of a constrained request (llguidance's LLMatcher,
    #: engine/runner/constraints.py): it has consumed every token the reply accepted.
    matcher: Any = None
    #: Its prompt's blocks on the disk tier: "" not looked up yet, "reading" (it waits for
    #: the reader thread), "done" (read back, or none there: not looked up again).
    disk_lookup: str = ""

    @property
    def session_id(self) -> str:
        return self.request.session_id

    @property
    def priority(self) -> Priority:
        return self.request.priority

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_in_table(self) -> int:
        """Tokens holding a slot in the block table: computed, or reserved for this step."""
        return self.table.num_tokens if self.table is not None else 0

    @property
    def length(self) -> int:
        """Tokens so far, the one still in flight included."""
        return len(self.tokens) + self.inflight

    @property
    def num_to_feed(self) -> int:
        """Tokens not yet given a slot: what the model still has to be fed."""
        return self.length - self.num_in_table

    def feed(self, start: int, n: int) -> list[int]:
        """Tokens ``start`` .. ``start + n``, PENDING standing for the one in flight."""
        tokens = self.tokens[start : start + n]
        if self.inflight and start + n > len(self.tokens):
            tokens.append(PENDING)
        return tokens

    @property
    def finished(self) -> bool:
        return self.state is SequenceState.FINISHED
