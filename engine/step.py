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
from engine.prefill_budget import PrefillBudget
from engine.sampling import SamplingRow, sample_rows
from engine.scheduler import Scheduler, StepPlan
from engine.sequence import Sequence
from engine.telemetry import StepTimes, Telemetry
from engine.work import SequenceWork

logger = logging.getLogger(__name__)


def sampling_row(seq: Sequence) -> SamplingRow:
    """What the sampler needs from ``seq`` (per sequence, so a failure here fails it alone;
    tests patch this to inject a fault)."""
    return SamplingRow(seq.request.params, seq.tokens, seq.key)


def describe(e: Exception) -> str:
    return f"generation failed: {type(e).__name__}: {e}"


class StepRunner:
    def __init__(self, scheduler: Scheduler, pool: KVPool, paged_model: PagedModel,
                 output: Output, telemetry: Telemetry, prefill: PrefillBudget) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.paged_model = paged_model
        self.output = output
        self.telemetry = telemetry
        self.prefill = prefill
        self._times = StepTimes()

    def step(self) -> None:
        times = self._times = StepTimes()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self.prefill.budget(self.scheduler.decoding))
        for seq, message in plan.failed:
            self.output.finish(seq, FinishReason.ERROR, message)
        if not plan.works:
            return
        self.pool.copy_blocks(plan.copies)
        times.schedule = time.perf_counter() - t0
        sampled = self._forward_and_sample(plan)
        t1 = time.perf_counter()
        self.scheduler.commit(plan)
        for seq, token in sampled:
            self._guard(seq, self.output.accept_token, seq, token)
        t2 = time.perf_counter()
        times.bookkeeping = t2 - t1
        decodes = sum(1 for w in plan.works if len(w.tokens) == 1)
        prompt_tokens = sum(len(w.tokens) for w in plan.works if len(w.tokens) != 1)
        self.prefill.observe(t2 - t0, decodes, prompt_tokens)
        self.telemetry.step(len(plan.works), t2 - t0, times)

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
        t0 = time.perf_counter()
        batch = build_step_batch(works)
        logits = self.paged_model.forward(batch)  # builds the lazy graph
        t1 = time.perf_counter()
        mx.eval(logits)  # a failing forward raises here, before any fork or sample
        t2 = time.perf_counter()
        self._times.build += t1 - t0
        self._times.forward += t2 - t1
        owners: list[int] = []
        seqs: list[Sequence] = []
        rows: list[SamplingRow] = []
        for i, owner in enumerate(batch.logit_owners):
            for s in self.scheduler.fork_samples(works[owner].seq):
                row = self._guard(s, sampling_row, s)
                if row is not None:
                    owners.append(i)
                    seqs.append(s)
                    rows.append(row)
        if not rows:
            return []
        if owners != list(range(logits.shape[0])):
            logits = logits[mx.array(owners, dtype=mx.int32)]
        try:
            return self._sample(logits, seqs, rows)
        except Exception as e:  # never raise past the forks above: isolate rows instead
            logger.warning("sampling failed (%s); sampling its %d rows alone", e, len(rows))
        sampled = []
        for j, (seq, row) in enumerate(zip(seqs, rows)):
            result = self._guard(seq, self._sample, logits[j : j + 1], [seq], [row])
            sampled.extend(result or [])
        return sampled

    def _sample(self, logits: mx.array, seqs: list[Sequence],
                rows: list[SamplingRow]) -> list[tuple[Sequence, int]]:
        t0 = time.perf_counter()
        tokens, keys = sample_rows(logits, rows)
        mx.eval(tokens, [k for k in keys if k is not None])
        for seq, key in zip(seqs, keys):
            seq.key = key
        sampled = list(zip(seqs, tokens.tolist()))  # one transfer for the whole step
        self._times.sample += time.perf_counter() - t0
        return sampled

    def _guard(self, seq: Sequence, fn, *args):
        """Run per-sequence work; an exception fails that sequence only."""
        try:
            return fn(*args)
        except Exception as e:
            logger.exception("request %s failed", seq.request.request_id)
            self.output.finish(seq, FinishReason.ERROR, describe(e))
            return None
