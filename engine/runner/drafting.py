"""Speculative decoding in a step, from the step runner's side (docs/ARCHITECTURE.md §3.13).

A decoding sequence granted drafts (engine/sched/draft_slots.py) feeds its last token and
the drafts as one short chunk; this module follows those rows through the step, so that the
step runner (engine/runner/step.py) only routes them:

* **at launch** (:meth:`Drafting.verify`): the rows are verified on the device
  (engine/runner/verify.py), lazily, with the step; their sequences' new tokens bypass the
  sampler's carried state, so a carry holding any of them is dropped;
* **when the step is read** (:meth:`Drafting.settle`): per sequence, the acceptance is
  recorded (the speculator's adaptive length, the counters), the table keeps the accepted
  drafts' slots and rolls the rest back, and the kept tokens are accepted in order;
* **when the step is rerun one sequence at a time** (:meth:`Drafting.alone`): the sequence
  decodes its one token and its drafts are rolled back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx

from engine.runner.carry import SamplerCarry
from engine.runner.output import Output
from engine.runner.step_batch import StepBatch
from engine.runner.telemetry import Telemetry
from engine.runner.verify import PendingDrafts, verify
from engine.sched.scheduler import Scheduler, StepPlan
from engine.sched.sequence import Sequence
from engine.sched.speculation import Speculator
from engine.sched.work import SequenceWork


class Drafting:
    def __init__(self, scheduler: Scheduler, output: Output, telemetry: Telemetry,
                 carry: SamplerCarry, speculator: Speculator,
                 fail: Callable[[Sequence, Exception], None]) -> None:
        self.scheduler = scheduler
        self.output = output
        self.telemetry = telemetry
        self.carry = carry
        self.speculator = speculator
        #: fails one sequence with an exception (the step runner's failure isolation)
        self.fail = fail
        scheduler.drafts.drafter = speculator.propose  # the scheduler asks it while planning

    def verify(self, plan: StepPlan, batch: StepBatch, logits: mx.array,
               rows: list[int]) -> PendingDrafts | None:
        """Verify the drafting works' logit ``rows``; None when verification fails (their
        sequences fail, alone)."""
        works = []
        for i in rows:
            work = plan.works[batch.logit_owners[i]]
            if not works or works[-1] is not work:
                works.append(work)
        seqs = [w.seq for w in works]
        last = self.carry.last
        if last is not None and last.seqs and any(id(s) in last.index for s in seqs):
            self.carry.drop()  # its windows would miss the accepted tokens
        try:
            return verify(logits[mx.array(rows, dtype=mx.int32)], seqs,
                          [w.drafts for w in works])
        except Exception as e:
            for seq in seqs:
                self.fail(seq, e)
            return None

    def settle(self, seq: Sequence, drafts: tuple[int, ...], accepted: int,
               tokens: list[int]) -> None:
        """A drafting sequence's verified step: its table keeps the accepted drafts' slots
        (the rest rolled back), then each kept token is accepted in order; EOS, a stop
        string or ``max_tokens`` among them ends the reply there (the rest are dropped)."""
        if seq.finished:
            return
        self.speculator.record(seq, len(drafts), accepted)
        self.telemetry.drafts(len(drafts), accepted)
        self.scheduler.drafts.settle(seq, accepted)
        for token in tokens:
            self.output.accept_token(seq, token)
            if seq.finished:
                break

    def alone(self, work: SequenceWork) -> SequenceWork:
        """``work`` as it runs on its own: a drafting work decodes its one token, its
        drafts rolled back."""
        if not work.drafts:
            return work
        self.scheduler.drafts.settle(work.seq, 0)
        return replace(work, tokens=work.tokens[:1], slots=work.slots[:1], drafts=())
