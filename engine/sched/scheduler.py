"""Continuous batching: which sequences run in the next step, and on which slots.

Each step, in this order:

1. every running sequence that is decoding gets a slot for its next token; when the pool is
   exhausted the latest-admitted sequence is **preempted** (its blocks freed, its tokens kept,
   requeued first for recompute) instead of anything failing;
2. waiting sequences are admitted (first reusing the prefix cache) while the batch, the
   per-step prompt-token budget and the free blocks allow;
3. sequences in the middle of a long prompt get the next **chunk** of it, within what is
   left of the budget, so a new chat never stalls the others for long.

Priorities (docs/ARCHITECTURE.md §3.3): waiting prompts are admitted and running prompts
continue highest priority first; background work, and a long paste whoever sent it, takes
only a guaranteed share of a step's prompt budget while a chat of higher priority is
running, so the chats in front of the user keep streaming and the long prompt still
finishes; preemption takes the lowest priority first, then the latest admitted. Every
sequence left waiting carries the reason, for the monitor.

It is the only user of the allocator besides the snapshot's read-only view: it also forks
the samples of an n > 1 request in the step that ends their shared prompt (the plan's
``forks``: the runner samples them from that prompt's logits), forks and prunes the beams
of a beam search once its group has decided a step (:meth:`advance_beams`; a beam search
is preempted whole), and frees a finished sequence's blocks when the runner hands it back
after the step (:meth:`remove`). Two collaborators answer for the features that hook into
admission and decoding: :class:`DiskAdmission` (engine/sched/disk_admission.py: a prompt
whose next blocks are on the disk tier waits for the reader) and :class:`DraftSlots`
(engine/sched/draft_slots.py: the slots a decoding sequence's speculative drafts take, and
their settling once verified).

The queues are dicts keyed by ``seq_id``, in order (admission order for ``running``, queue
order for ``waiting``): membership and removal cost the same at 64 sequences as at 2.

Pure bookkeeping on the allocator: no MLX here, so every decision is unit-testable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import Priority
from engine.events import SequenceState
from engine.kv.block_table import PENDING, BlockTable, chain_hash
from engine.kv.blocks import BlockAllocator
from engine.sched.beams import BeamGroup, BeamStep
from engine.sched.disk_admission import DiskAdmission
from engine.sched.draft_slots import DraftSlots
from engine.sched.room import tokens_that_fit
from engine.sched.sequence import Sequence
from engine.sched.work import SequenceWork

#: A prompt with more tokens than this still to read is a long paste: while other chats run,
#: it advances as background work, whatever its chat's priority.
LONG_PROMPT_TOKENS = 1024
#: The share of a full prompt chunk (``prefill_chunk``) that background work (and a long
#: paste) takes at most per step while a chat of higher priority runs: small enough to leave
#: room for that chat's prompt, never zero. A share of the chunk, not of the step's budget:
#: the adaptive budget (engine/sched/prefill_budget.py) already keeps the step within its
#: time target for the chats that decode, and a share of it on top starved the paste (2-3
#: tokens a step beside one streaming chat on the CPU).
BACKGROUND_SHARE = 0.25

WAIT_BATCH = "waiting: the batch is full"
WAIT_POOL = "waiting: the KV pool is full"
WAIT_PREFIX = "waiting: its prompt's first blocks are being computed for another chat"
WAIT_BUDGET = "waiting: this step's prompt budget went to chats of higher priority"
WAIT_YIELD = "reading its prompt slowly: chats of higher priority are running"
WAIT_PREEMPTED = "preempted: the pool was full; it will be recomputed"
WAIT_DISK = "reading its context back from disk"


@dataclass
class StepPlan:
    works: list[SequenceWork] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)
    #: the samples of an n > 1 request forked in this step, by the seq_id of the sequence
    #: whose prompt ended (they share its blocks and draw from its logits)
    forks: dict[int, list[Sequence]] = field(default_factory=dict)

    def fanout(self, work: SequenceWork) -> list[Sequence]:
        """The sequences drawing a token from ``work``'s logits: its own, plus the samples
        forked from it in this step."""
        return [work.seq, *self.forks.get(work.seq.seq_id, ())]


@dataclass(frozen=True)
class YieldShare:
    """What a yielding prompt (background work, a long paste) may take of one step while a
    chat of higher priority runs: ``share`` tokens, or what is left of the step's
    ``free_tokens`` (those it carries at a decode step's cost) once ``taken`` prompt tokens
    are in it, whichever is more."""

    share: int
    free_tokens: int = 0

    def cap(self, taken: int) -> int:
        return max(self.share, self.free_tokens - taken)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_batch: int, prefill_chunk: int) -> None:
        self.alloc = allocator
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        #: seq_id -> sequence, in queue order (a preempted one goes back to the front)
        self.waiting: dict[int, Sequence] = {}
        #: seq_id -> sequence, in admission order
        self.running: dict[int, Sequence] = {}
        self.steps = 0
        self.preemptions = 0
        #: Admission's lookups on the disk tier (its ``tier`` None: the tier is off).
        self.disk = DiskAdmission(allocator)
        #: Speculative drafts' slots (its ``drafter`` None: no drafting).
        self.drafts = DraftSlots(allocator)

    # ---- queue management -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.state = SequenceState.WAITING
        self.waiting[seq.seq_id] = seq

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, cancelled, failed) and free its blocks. The runner
        calls it for the sequences the output ended, once their step is over
        (``StepRunner.release_finished``)."""
        if self.running.pop(seq.seq_id, None) is None:
            self.waiting.pop(seq.seq_id, None)
        if seq.table is not None:
            self.alloc.free(seq.table)
            seq.table = None

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def only_reading_disk(self) -> bool:
        """Nothing can run until the disk tier's reader answers: the engine may sleep on its
        inbox (the reader wakes it)."""
        return (not self.running and bool(self.waiting)
                and all(self.disk.reading(s) for s in self.waiting.values()))

    def disk_read_done(self, seq_id: int) -> None:
        """The reader answered for ``seq_id``: admitted as usual (``DiskAdmission.read_done``)."""
        self.disk.read_done(self.waiting.get(seq_id))

    @property
    def capacity_tokens(self) -> int:
        return self.alloc.num_blocks * self.alloc.block_size

    # ---- one step ---------------------------------------------------------------------------

    @property
    def decoding(self) -> bool:
        """Some running sequence needs just its next token (it would decode this step)."""
        return any(seq.num_to_feed == 1 for seq in self.running.values())

    @property
    def prompt_context(self) -> int:
        """The longest context a prompt under way continues from (0 when none is): what
        its next chunk's tokens attend to, so what they cost (engine/sched/prefill_budget.py)."""
        return max((s.num_in_table for s in self.running.values() if s.num_to_feed >= 2),
                   default=0)

    def schedule(self, prompt_budget: int | None = None,
                 continue_prompts: bool = True, free_tokens: int = 0) -> StepPlan:
        """Plan one step; ``prompt_budget`` caps its prompt tokens (default: prefill_chunk);
        ``continue_prompts`` False: the prompts under way skip this step (a long paste's
        chunk costs more than one step allows, engine/sched/prefill_budget.py), new ones are
        still admitted; ``free_tokens``: how many of the budget's tokens the step carries at
        no measurable cost to the chats decoding in it (the budget's knee on a launch-bound
        GPU, ``PrefillBudget.free_tokens``; 0 where a prompt token always costs).

        Waiting prompts are admitted before running prompts continue (highest priority, then
        shortest first, with at most half the budget while some prompt is mid-way, so that
        one still advances every step), and running prompts continue highest priority, then
        shortest-remaining first: a short chat arriving during a long paste gets its first
        token after a few steps, not after the whole paste. Background work and long pastes
        take at most ``BACKGROUND_SHARE`` of a full chunk, or what is left of the step's free
        tokens where that is more (and never more than the step's budget), while a chat of
        higher priority runs: a yield below the free tokens buys the chats above it nothing.
        (On an H100 the share held a paste at 64 tokens a step in steps that cost about a
        decode step, 5.5 ms against 5.0: bench/results/gpu.md, session 23; and the budget
        could not learn whether more were free.)
        """
        self.steps += 1
        plan = StepPlan()
        budget = self.prefill_chunk if prompt_budget is None else prompt_budget
        scheduled: set[int] = set()

        for seq in list(self.running.values()):
            if seq.seq_id not in self.running or seq.num_to_feed != 1:
                continue
            if seq.inflight and seq.num_generated + 1 >= seq.request.params.max_tokens:
                continue  # its token in flight is its last: nothing to compute after it
            if self._make_room(seq, 1, plan):
                self._reserve(seq, 1, plan, self.drafts.granted(seq, len(self.running)))
                scheduled.add(seq.seq_id)

        share = YieldShare(max(1, int(self.prefill_chunk * BACKGROUND_SHARE)), free_tokens)
        mid_prompt = any(s.num_to_feed >= 2 for s in self.running.values())
        # Only a prompt to read can yield: a step of decodes alone needs no ranking.
        urgent = self._most_urgent() if mid_prompt or self.waiting else None
        # half for new prompts while one is under way (it advances every step), unless it
        # skips this step
        admit_budget = max(1, budget // 2) if mid_prompt and continue_prompts else budget
        taken = self._admit(plan, min(budget, admit_budget), scheduled, urgent, share)
        budget -= taken

        under_way = [s for s in self.running.values()
                     if s.num_to_feed >= 2 and s.seq_id not in scheduled]
        for seq in sorted(under_way, key=lambda s: (-self._rank(s), s.num_to_feed)):
            if seq.seq_id not in self.running:
                continue
            if not continue_prompts:
                seq.waiting_reason = WAIT_YIELD
                continue
            if budget <= 0:
                seq.waiting_reason = WAIT_BUDGET
                continue
            yields = self._yields(seq, urgent)
            cap = share.cap(taken) if yields else budget
            n = min(budget, cap, seq.num_to_feed)
            n = min(n, tokens_that_fit(self.alloc, seq.table))
            if n < 1:
                if not self._make_room(seq, 1, plan):
                    continue
                n = min(budget, cap, seq.num_to_feed, tokens_that_fit(self.alloc, seq.table))
            seq.waiting_reason = (WAIT_YIELD if yields and n == cap < min(budget, seq.num_to_feed)
                                  else "")
            self._reserve(seq, n, plan)
            scheduled.add(seq.seq_id)
            budget -= n
            taken += n
        self._fork_samples(plan)
        return plan

    def _fork_samples(self, plan: StepPlan) -> None:
        """Fork the samples of every n > 1 request whose prompt this step ends: they copy
        its tokens, share its blocks (the step's reservation included) and join the batch
        decoding; the runner samples each from the prompt's logits (``plan.fanout``).
        They join ``running`` in the order the step's batch lays out its logits (one-token
        works first, engine/runner/step_batch.py), as when the runner forked them."""
        ending = [w for w in plan.works if w.want_logits and not w.seq.request.forked
                  and w.seq.request.params.n > 1 and w.seq.request.beams is None]
        for work in sorted(ending, key=lambda w: len(w.tokens) != 1):
            seq, request = work.seq, work.seq.request
            request.forked = True
            forks = plan.forks[seq.seq_id] = []
            for sibling in request.sequences[1:]:
                if sibling.finished:
                    continue
                sibling.tokens = list(seq.tokens)
                sibling.table = self.alloc.fork(seq.table)
                if seq.matcher is not None:  # at the prompt's end: the same grammar state
                    sibling.matcher = seq.matcher.deep_copy()
                sibling.state = SequenceState.DECODING
                sibling.admitted_at = seq.admitted_at
                self.running[sibling.seq_id] = sibling
                forks.append(sibling)

    def advance_beams(self, group: BeamGroup, step: BeamStep) -> list[Sequence]:
        """Place a beam search's decided continuations on its sequences, through the
        allocator: a beam no continuation extends is pruned first (its table freed at once:
        private blocks back to the pool, shared ones dereferenced); each parent's best
        continuation goes on in the parent's own sequence; every further one takes a free
        sequence of the request, forked from the parent (its table copied, each block's
        refcount + 1). Nothing is copied here: the next step's append copies a shared
        partial block on write, once for each extra child. Returns the new live beams, best
        first, each holding its continuation's token (to be fed next step)."""
        extended = {id(c.parent) for c in step.continuations}
        for beam in group.live:
            if id(beam) not in extended:
                self._vacate(beam)
        live = {id(s) for s in group.live}
        spare = [s for s in group.request.sequences
                 if id(s) not in live or id(s) not in extended]
        placed: list[tuple[Sequence, Sequence, int]] = []  # (sequence, parent, token)
        going_on: set[int] = set()
        for c in step.continuations:
            if id(c.parent) in going_on:
                placed.append((spare.pop(0), c.parent, c.token))
            else:
                going_on.add(id(c.parent))
                placed.append((c.parent, c.parent, c.token))
        for seq, parent, token in placed:  # forks first: they copy the parent as it was
            if seq is not parent:
                seq.tokens = [*parent.tokens, token]
                seq.table = self.alloc.fork(parent.table)
                seq.state = SequenceState.DECODING
                seq.admitted_at = parent.admitted_at
                seq.waiting_reason = ""
                self.running[seq.seq_id] = seq
        for seq, parent, token in placed:
            if seq is parent:
                seq.tokens.append(token)
        group.advanced([(seq, c.logprob) for (seq, _, _), c in zip(placed, step.continuations)])
        return [seq for seq, _, _ in placed]

    def _vacate(self, seq: Sequence) -> None:
        """A pruned beam: out of the queues, its blocks released now; its sequence waits,
        empty, to carry a later fork of the same search."""
        self.running.pop(seq.seq_id, None)
        self.waiting.pop(seq.seq_id, None)
        if seq.table is not None:
            self.alloc.free(seq.table)
            seq.table = None
        seq.state = SequenceState.WAITING
        seq.waiting_reason = ""

    def set_priority(self, session_id: str, priority: Priority) -> None:
        """Every live request of ``session_id`` (running or waiting) takes ``priority``."""
        for seq in [*self.running.values(), *self.waiting.values()]:
            if seq.session_id == session_id:
                seq.request.priority = priority

    def _rank(self, seq: Sequence) -> Priority:
        """The priority a sequence's prompt is scheduled with: a long paste counts as
        background work, whoever sent it."""
        if seq.num_to_feed > LONG_PROMPT_TOKENS:
            return Priority.BACKGROUND
        return seq.priority

    def _most_urgent(self) -> Priority | None:
        """The highest rank among the chats that will want this step (decoding, or with a
        prompt to read), or None when there are none. A walk over every sequence: asked
        only in a step with a prompt to read."""
        ranks = [self._rank(s) for s in self.running.values()]
        ranks += [self._rank(s) for s in self.waiting.values()]
        return max(ranks, default=None)

    def _yields(self, seq: Sequence, urgent: Priority | None) -> bool:
        """``seq``'s prompt takes only the background share of the budget: a chat of a
        higher rank wants this step (the most urgent rank is another chat's when it is
        above ``seq``'s own)."""
        return urgent is not None and self._rank(seq) < urgent

    def _admit(self, plan: StepPlan, budget: int, scheduled: set[int],
               urgent: Priority | None = None, share: YieldShare | None = None) -> int:
        """Admit waiting sequences (reusing the prefix cache) within ``budget`` prompt
        tokens, the batch limit and the free blocks; returns the tokens it reserved."""
        used = 0
        # Highest priority first, preempted sequences (they were running) before new ones,
        # then the shortest prompts: a batch of short chats arriving with a long paste all
        # start before it.
        order = sorted(self.waiting.values(), key=lambda s: (-self._rank(s),
                                                    s.state is not SequenceState.PREEMPTED,
                                                    s.length))
        blocked = ""  # once set, nothing later in the order is admitted this step
        # A beam search preempted in this step freed more than the step needed: taken back
        # at once, its beams would recompute only to be preempted again.
        just_preempted = {s.seq_id for s in plan.preempted if s.request.beams is not None}
        for seq in order:
            if seq.seq_id in just_preempted:
                self._wait(seq, WAIT_POOL)
                continue
            if self.disk.reading(seq):  # the others go on meanwhile
                seq.waiting_reason = WAIT_DISK
                continue
            if not blocked and used >= budget:
                blocked = WAIT_BUDGET
            if not blocked and len(self.running) >= self.max_batch:
                blocked = WAIT_BATCH
            if blocked:
                self._wait(seq, blocked)
                continue
            if seq.state is SequenceState.PREEMPTED and not self._beams_fit(seq):
                blocked = WAIT_POOL
                self._wait(seq, blocked)
                continue
            if seq.length > self.capacity_tokens - 1:
                del self.waiting[seq.seq_id]
                plan.failed.append((seq, self._too_long_message(seq.length)))
                continue
            private = seq.request.incognito
            table = BlockTable(owner=seq.session_id, private=private)
            cached = 0 if private else self.alloc.reuse_prefix(table, seq.tokens, count=False)
            if not private and self.alloc.prefix_pending(table, seq.tokens):
                self.alloc.free(table)  # its next blocks are being computed: share them next step
                self._wait(seq, WAIT_PREFIX)
                continue
            if not private and self.disk.read_back(seq, table):
                self.alloc.free(table)
                seq.waiting_reason = WAIT_DISK
                continue
            cap = budget - used
            yields = share is not None and self._yields(seq, urgent)
            if yields:
                cap = min(cap, share.cap(used))
            n = min(cap, seq.length - cached, tokens_that_fit(self.alloc, table))
            if n < 1:
                self.alloc.free(table)
                blocked = WAIT_POOL
                self._wait(seq, blocked)
                continue
            self.alloc.record_prefix_lookup(table, seq.tokens)
            del self.waiting[seq.seq_id]
            seq.table = table
            seq.admitted_at = self.steps
            if seq.state is SequenceState.WAITING and seq.num_generated == 0:
                seq.request.cached_prompt_tokens = max(seq.request.cached_prompt_tokens, cached)
            seq.state = SequenceState.PREFILLING
            seq.waiting_reason = (WAIT_YIELD if yields and n == cap < min(budget - used,
                                                                        seq.length - cached)
                                  else "")
            self.running[seq.seq_id] = seq
            self._reserve(seq, n, plan)
            scheduled.add(seq.seq_id)
            used += n
        return used

    def _beams_fit(self, seq: Sequence) -> bool:
        """A preempted beam search comes back whole: its beams step together, so beams
        taken back while the pool cannot hold their siblings would only sit on their blocks.
        True unless ``seq`` is a beam whose waiting siblings (and itself) need more blocks
        than are available: their distinct full blocks not held by anyone (beams share
        their common blocks again through the prefix cache) plus one partial block each."""
        group = seq.request.beams
        if group is None or all(s.request is seq.request for s in self.running.values()):
            return True  # nothing else holds blocks: it fits now or never (_make_room says)
        waiting = [s for s in group.live if s.seq_id in self.waiting]
        if len(waiting) + len(self.running) > self.max_batch:
            return False
        bs = self.alloc.block_size
        seen: set[int] = set()
        needed = 0
        for beam in waiting:
            parent = None
            for i in range(len(beam.tokens) // bs):
                parent = chain_hash(parent, beam.tokens[i * bs : (i + 1) * bs])
                if parent in seen:
                    continue
                seen.add(parent)
                block = self.alloc.prefix_index.block_for(parent)
                if block is None or not self.alloc.refcount(block):
                    needed += 1
            needed += 1 if len(beam.tokens) % bs else 0
        return needed <= self.alloc.num_available

    @staticmethod
    def _wait(seq: Sequence, reason: str) -> None:
        """Why ``seq`` waits, for the monitor; a preempted one says so until it runs again."""
        seq.waiting_reason = WAIT_PREEMPTED if seq.state is SequenceState.PREEMPTED else reason

    def resolve(self, seq: Sequence, token: int) -> None:
        """``seq``'s oldest token in flight has been read: fill its PENDING slot, if it has
        one (a newer token of ``seq`` may be in flight already: it stays counted). A sequence
        that has finished is left alone: its blocks go back as they are after the step."""
        seq.inflight = max(0, seq.inflight - 1)
        table = seq.table
        if seq.finished or table is None:
            return
        if table.tokens and table.tokens[-1] == PENDING:
            self.alloc.resolve_pending(table, token)

    def commit(self, plan: StepPlan) -> None:
        """The step ran: its slots now hold K/V (names the newly full blocks in the cache).
        A sequence that finished during the step (its forward or its sampling failed, or the
        step before it ended it) is skipped: its blocks go back after the step, unnamed."""
        for work in plan.works:
            if not work.seq.finished and work.seq.table is not None:
                self.alloc.mark_computed(work.seq.table)
                if work.want_logits:
                    work.seq.state = SequenceState.DECODING

    # ---- internals --------------------------------------------------------------------------

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan, drafts: list[int] = ()) -> None:
        start = seq.num_in_table
        tokens = seq.feed(start, n) + list(drafts)
        result = self.alloc.append(seq.table, tokens, provisional=len(drafts))
        plan.copies.extend(result.copies)
        done = start + n == seq.length
        plan.works.append(SequenceWork(tokens, start, seq.table.blocks, result.slots,
                                       want_logits=done, seq=seq, drafts=tuple(drafts)))

    def _make_room(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Preempt the latest-admitted sequences until ``seq`` can take ``n`` more tokens.
        False if ``seq`` itself was preempted or failed."""
        while self.alloc.blocks_needed(seq.table, n) > self.alloc.num_available:
            # The lowest priority first, then the latest admitted.
            victim = max(self.running.values(),
                         key=lambda s: (-s.priority, s.admitted_at, s.seq_id))
            if victim is seq and len(self.running) == 1:
                del self.running[seq.seq_id]
                plan.failed.append((seq, self._too_long_message(len(seq.tokens) + n)))
                return False
            request = seq.request
            if request.beams is not None and all(s.request is request
                                                 for s in self.running.values()):
                # the beam search is all that runs and still does not fit: it never will
                for beam in [s for s in self.running.values()]:
                    del self.running[beam.seq_id]
                plan.works = [w for w in plan.works if w.seq.request is not request]
                plan.failed.append((seq, self._too_long_message(len(seq.tokens) + n)))
                return False
            self._preempt(victim, plan)
            if seq.table is None:  # preempted itself (or with its beam search)
                return False
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Preempt ``seq``, and with a beam every live beam of its search: the beams step
        together, so one left behind would hold the others' blocks idle."""
        group = seq.request.beams
        if group is None:
            self._preempt_one(seq, plan)
            return
        for beam in group.live:
            if beam.seq_id in self.running:
                self._preempt_one(beam, plan)
        group.preempted()

    def _preempt_one(self, seq: Sequence, plan: StepPlan) -> None:
        del self.running[seq.seq_id]
        # Its reservations of this step, if any, go too: their slots are about to be freed.
        plan.works = [w for w in plan.works if w.seq is not seq]
        self.alloc.free(seq.table)
        seq.table = None
        seq.state = SequenceState.PREEMPTED
        self.disk.look_again(seq)
        seq.waiting_reason = WAIT_PREEMPTED
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting = {seq.seq_id: seq, **self.waiting}  # first in the queue (rare: O(n))
        plan.preempted.append(seq)

    def _too_long_message(self, tokens: int) -> str:
        return (
            f"this conversation needs {tokens} tokens of KV cache but the whole pool holds "
            f"{self.capacity_tokens}: raise the KV memory budget or start a new chat"
        )
