"""One engine step: schedule -> copy -> forward -> sample -> commit, with failure isolation.

A failing forward is retried one sequence at a time so that only the culprits fail; an
exception while handling one sequence (sampling, accepting its token) fails that sequence
only. Nothing here touches the allocator: forks and frees go through the scheduler.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from engine.events import FinishReason
from engine.kv_pool import KVPool
from engine.model_adapter import PagedModel, build_step_batch
from engine.output import Output
from engine.sampling import sample_next
from engine.scheduler import Scheduler, StepPlan
from engine.sequence import Sequence
from engine.telemetry import Telemetry
from engine.work import SequenceWork

logger = logging.getLogger(__name__)


def sample_row(seq: Sequence, logits: mx.array) -> mx.array:
    """The next token of ``seq`` (lazy), advancing its PRNG key."""
    token, seq.key = sample_next(logits, seq.request.params, seq.tokens, seq.key)
    return token


def describe(e: Exception) -> str:
    return f"generation failed: {type(e).__name__}: {e}"


class StepRunner:
    def __init__(self, scheduler: Scheduler, pool: KVPool, paged_model: PagedModel,
                 output: Output, telemetry: Telemetry) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.paged_model = paged_model
        self.output = output
        self.telemetry = telemetry

    def step(self) -> None:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        for seq, message in plan.failed:
            self.output.finish(seq, FinishReason.ERROR, message)
        if not plan.works:
            return
        self.pool.copy_blocks(plan.copies)
        t_sched = time.perf_counter() - t0
        sampled = self._forward_and_sample(plan)
        t1 = time.perf_counter()
        self.scheduler.commit(plan)
        for seq, token in sampled:
            self._guard(seq, self.output.accept_token, seq, token)
        t2 = time.perf_counter()
        self.telemetry.step(len(plan.works), t2 - t0, t_sched + t2 - t1)

    def _forward_and_sample(self, plan: StepPlan) -> list[tuple[Sequence, int]]:
        """Run the batch; on failure, run each sequence alone to fail only the culprits."""
        try:
            return self._run_works(plan.works)
        except Exception as e:
            if len(plan.works) == 1:
                self.output.finish(plan.works[0].seq, FinishReason.ERROR, describe(e))
                return []
            logger.warning("step failed (%s); isolating its %d sequences", e, len(plan.works))
        sampled = []
        for work in plan.works:
            try:
                sampled.extend(self._run_works([work]))
            except Exception as e:
                self.output.finish(work.seq, FinishReason.ERROR, describe(e))
        return sampled

    def _run_works(self, works: list[SequenceWork]) -> list[tuple[Sequence, int]]:
        batch = build_step_batch(works)
        logits = self.paged_model.forward(batch)
        mx.eval(logits)  # a failing forward raises here, before any fork or sample
        rows: list[tuple[Sequence, mx.array]] = []
        for i, owner in enumerate(batch.logit_owners):
            for s in self.scheduler.fork_samples(works[owner].seq):
                token = self._guard(s, sample_row, s, logits[i])
                if token is not None:
                    rows.append((s, token))
        mx.eval([t for _, t in rows])
        return [(s, t.item()) for s, t in rows]

    def _guard(self, seq: Sequence, fn, *args):
        """Run per-sequence work; an exception fails that sequence only."""
        try:
            return fn(*args)
        except Exception as e:
            logger.exception("request %s failed", seq.request.request_id)
            self.output.finish(seq, FinishReason.ERROR, describe(e))
            return None
