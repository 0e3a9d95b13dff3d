"""Continuous batching: which sequences run in the next step, and on which slots.

Each step, in this order:

1. every running sequence that is decoding gets a slot for its next token; when the pool is
   exhausted the latest-admitted sequence is **preempted** (its blocks freed, its tokens kept,
   requeued first for recompute) instead of anything failing;
2. waiting sequences are admitted (first reusing the prefix cache) while the batch, the
   per-step prompt-token budget and the free blocks allow;
3. sequences in the middle of a long prompt get the next **chunk** of it, within what is
   left of the budget, so a new chat never stalls the others for long.

It is the only user of the allocator besides the snapshot's read-only view: it also forks
the samples of an n > 1 request when their shared prompt is done (:meth:`fork_samples`).

Pure bookkeeping on the allocator: no MLX here, so every decision is unit-testable.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_table import PENDING, BlockTable
from engine.blocks import BlockAllocator
from engine.events import SequenceState
from engine.sequence import Sequence
from engine.work import SequenceWork


@dataclass
class StepPlan:
    works: list[SequenceWork] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_batch: int, prefill_chunk: int) -> None:
        self.alloc = allocator
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.steps = 0
        self.preemptions = 0

    # ---- queue management -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.state = SequenceState.WAITING
        self.waiting.append(seq)

    def fork_samples(self, seq: Sequence) -> list[Sequence]:
        """The sequences that draw from ``seq``'s logits: itself, plus its siblings the
        first time a request with n > 1 reaches them (they fork from it, sharing its blocks,
        and join the batch directly)."""
        request = seq.request
        if request.forked or request.params.n == 1:
            return [seq]
        request.forked = True
        siblings = [seq]
        for sibling in request.sequences[1:]:
            if sibling.finished:
                continue
            sibling.tokens = list(seq.tokens)
            sibling.table = self.alloc.fork(seq.table)
            sibling.state = SequenceState.DECODING
            sibling.admitted_at = seq.admitted_at
            self.running.append(sibling)
            siblings.append(sibling)
        return siblings

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, cancelled, failed) and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.table is not None:
            self.alloc.free(seq.table)
            seq.table = None

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def capacity_tokens(self) -> int:
        return self.alloc.num_blocks * self.alloc.block_size

    # ---- one step ---------------------------------------------------------------------------

    @property
    def decoding(self) -> bool:
        """Some running sequence needs just its next token (it would decode this step)."""
        return any(seq.num_to_feed == 1 for seq in self.running)

    def schedule(self, prompt_budget: int | None = None) -> StepPlan:
        """Plan one step; ``prompt_budget`` caps its prompt tokens (default: prefill_chunk).

        Waiting prompts are admitted before running prompts continue (shortest first, with
        at most half the budget while some prompt is mid-way, so that one still advances
        every step), and running prompts continue shortest-remaining first: a short chat
        arriving during a long paste gets its first token after a few steps, not after the
        whole paste.
        """
        self.steps += 1
        plan = StepPlan()
        budget = self.prefill_chunk if prompt_budget is None else prompt_budget
        scheduled: set[int] = set()

        for seq in list(self.running):
            if seq not in self.running or seq.num_to_feed != 1:
                continue
            if seq.inflight and seq.num_generated + 1 >= seq.request.params.max_tokens:
                continue  # its token in flight is its last: nothing to compute after it
            if self._make_room(seq, 1, plan):
                self._reserve(seq, 1, plan)
                scheduled.add(seq.seq_id)

        mid_prompt = any(s.num_to_feed >= 2 for s in self.running)
        admit_budget = max(1, budget // 2) if mid_prompt else budget
        budget -= self._admit(plan, min(budget, admit_budget), scheduled)

        for seq in sorted(self.running, key=lambda s: s.num_to_feed):
            if budget <= 0:
                break
            if seq not in self.running or seq.seq_id in scheduled or seq.num_to_feed < 2:
                continue
            n = min(budget, seq.num_to_feed)
            n = min(n, self._tokens_that_fit(seq.table))
            if n < 1:
                if not self._make_room(seq, 1, plan):
                    continue
                n = min(budget, seq.num_to_feed, self._tokens_that_fit(seq.table))
            self._reserve(seq, n, plan)
            scheduled.add(seq.seq_id)
            budget -= n
        return plan

    def _admit(self, plan: StepPlan, budget: int, scheduled: set[int]) -> int:
        """Admit waiting sequences (reusing the prefix cache) within ``budget`` prompt
        tokens, the batch limit and the free blocks; returns the tokens it reserved."""
        used = 0
        # Preempted sequences first (they were running), then the shortest prompts: a batch
        # of short chats arriving with a long paste all start before it.
        order = sorted(self.waiting, key=lambda s: (s.state is not SequenceState.PREEMPTED,
                                                    s.length))
        for seq in order:
            if used >= budget or len(self.running) >= self.max_batch:
                break
            if seq.length > self.capacity_tokens - 1:
                self.waiting.remove(seq)
                plan.failed.append((seq, self._too_long_message(seq.length)))
                continue
            table = BlockTable(owner=seq.session_id)
            cached = self.alloc.reuse_prefix(table, seq.tokens, count=False)
            if self.alloc.prefix_pending(table, seq.tokens):
                self.alloc.free(table)  # its next blocks are being computed: share them next step
                continue
            n = min(budget - used, seq.length - cached, self._tokens_that_fit(table))
            if n < 1:
                self.alloc.free(table)
                break
            self.alloc.record_prefix_lookup(table, seq.tokens)
            self.waiting.remove(seq)
            seq.table = table
            seq.admitted_at = self.steps
            if seq.state is SequenceState.WAITING and seq.num_generated == 0:
                seq.request.cached_prompt_tokens = max(seq.request.cached_prompt_tokens, cached)
            seq.state = SequenceState.PREFILLING
            self.running.append(seq)
            self._reserve(seq, n, plan)
            scheduled.add(seq.seq_id)
            used += n
        return used

    def resolve(self, seq: Sequence, token: int) -> None:
        """``seq``'s oldest token in flight has been read: fill its PENDING slot, if it has
        one (a newer token of ``seq`` may be in flight already: it stays counted)."""
        seq.inflight = max(0, seq.inflight - 1)
        table = seq.table
        if table is not None and table.tokens and table.tokens[-1] == PENDING:
            self.alloc.resolve_pending(table, token)

    def commit(self, plan: StepPlan) -> None:
        """The step ran: its slots now hold K/V (names the newly full blocks in the cache)."""
        for work in plan.works:
            if work.seq.table is not None:
                self.alloc.mark_computed(work.seq.table)
                if work.want_logits:
                    work.seq.state = SequenceState.DECODING

    # ---- internals --------------------------------------------------------------------------

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan) -> None:
        start = seq.num_in_table
        tokens = seq.feed(start, n)
        result = self.alloc.append(seq.table, tokens)
        plan.copies.extend(result.copies)
        done = start + n == seq.length
        plan.works.append(
            SequenceWork(tokens, start, seq.table.blocks, result.slots, want_logits=done, seq=seq)
        )

    def _tokens_that_fit(self, table: BlockTable) -> int:
        """The most tokens ``table`` can take now without preempting anyone."""
        bs = self.alloc.block_size
        available = self.alloc.num_available
        room = (bs - table.num_tokens % bs) % bs
        if room and self.alloc.refcount(table.blocks[-1]) > 1:  # copy-on-write takes a block
            if not available:
                return 0
            available -= 1
        return room + available * bs

    def _make_room(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Preempt the latest-admitted sequences until ``seq`` can take ``n`` more tokens.
        False if ``seq`` itself was preempted or failed."""
        while self.alloc.blocks_needed(seq.table, n) > self.alloc.num_available:
            victim = max(self.running, key=lambda s: (s.admitted_at, s.seq_id))
            if victim is seq and len(self.running) == 1:
                self.running.remove(seq)
                plan.failed.append((seq, self._too_long_message(len(seq.tokens) + n)))
                return False
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        # Its reservations of this step, if any, go too: their slots are about to be freed.
        plan.works = [w for w in plan.works if w.seq is not seq]
        self.alloc.free(seq.table)
        seq.table = None
        seq.state = SequenceState.PREEMPTED
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _too_long_message(self, tokens: int) -> str:
        return (
            f"this conversation needs {tokens} tokens of KV cache but the whole pool holds "
            f"{self.capacity_tokens}: raise the KV memory budget or start a new chat"
        )
