"""One engine step: schedule -> launch -> finish the previous step, with failure isolation.

``StepRunner.step`` has one shape:

1. **schedule**: the scheduler plans the step (``StepPlan``): every sequence's work, the
   block copies, refusals, and the samples of an n > 1 request forked from its prompt;
2. **launch**: copy the blocks, build the batch, run the model and draw every row's token,
   all lazily (``mx.async_eval``), then commit the plan (its slots hold K/V);
3. **finish the previous step**: read the step launched before (the one device-to-host
   transfer), accept its tokens (events, EOS, stop strings, ``max_tokens``), and hand the
   sequences the output ended back to the scheduler (``release_finished``).

Overlapped, as mlx-lm's ``BatchGenerator``: step t+1 is launched with step t's sampled
tokens still on the device (they are fed as PENDING slots, engine/kv/blocks.py), and only
then are step t's tokens read, emitted and checked; the host's work hides behind the
device's. A sequence that step t ends (EOS, stop string, cancel) has had at most one more
token computed, which is dropped, never emitted: ``Output.accept_token`` ignores finished
sequences. A reply whose token in flight is its last (max_tokens) is not scheduled again.
The sampler's per-row state is carried on the device between steps (engine/runner/carry.py),
so every step overlaps whatever its rows' sampling parameters. A sequence counts its tokens
in flight (``Sequence.inflight``: two between step t+1's launch and step t's read), so
reading step t never hides step t+1's token from the scheduler, and every sequence decodes
in every step.

The step in flight ends in one place (``_end_inflight``): read and accepted at the end of
the next step, earlier when the next step needs its tokens on the host (a reply the pool
cannot hold keeps its last token; a step run one sequence at a time feeds them), or dropped
unread when the engine stops. A failing forward is retried one sequence at a time so that
only the culprits fail (``_isolate`` and ``_rerun`` share ``_run_alone``); an exception
while handling one sequence (sampling, accepting its token) fails that sequence only.
Nothing here touches the allocator: forks, commits and frees go through the scheduler.

A beam search's rows are not sampled: their best next tokens are found on the device
(engine/runner/beams.py) and read with the step; once a search's every live beam has
reported, its group decides and the scheduler forks and prunes the beams
(``_step_beams``, docs/ARCHITECTURE.md §3.12). A step holding beam rows is read before the
next one is scheduled, as a constrained row's is (``Launched.synchronous``). A sequence
verifying speculative drafts is read before the next step too; its rows are verified at
launch and settled when read by engine/runner/drafting.py (docs/ARCHITECTURE.md §3.13).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import mlx.core as mx

from engine.events import FinishReason
from engine.kv.block_table import PENDING
from engine.kv.pool import KVPool
from engine.runner.beams import beam_candidates
from engine.runner.carry import Launched, SamplerCarry, StepShape, set_key
from engine.runner.constraints import apply_bitmask
from engine.runner.drafting import Drafting
from engine.runner.logprobs import pending_logprobs
from engine.runner.model_adapter import PagedModel
from engine.runner.output import Output
from engine.runner.sampling import SamplingRow, draw, sample_rows
from engine.runner.step_batch import StepBatch, build_step_batch
from engine.runner.telemetry import StepTimes, Telemetry
from engine.sched.beams import BeamGroup
from engine.sched.prefill_budget import PrefillBudget
from engine.sched.scheduler import Scheduler, StepPlan
from engine.sched.sequence import Sequence
from engine.sched.speculation import Speculator
from engine.sched.work import SequenceWork

logger = logging.getLogger(__name__)


def sampling_row(seq: Sequence) -> SamplingRow:
    """What the sampler needs from ``seq`` (per sequence, so a failure here fails it alone;
    tests patch this to inject a fault)."""
    return SamplingRow(seq.request.params, seq.tokens, seq.key)


def describe(e: Exception) -> str:
    return f"generation failed: {type(e).__name__}: {e}"


class StepRunner:
    def __init__(self, scheduler: Scheduler, pool: KVPool, paged_model: PagedModel,
                 output: Output, telemetry: Telemetry, prefill: PrefillBudget,
                 overlap: bool = True, speculator: Speculator | None = None) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.paged_model = paged_model
        self.output = output
        self.telemetry = telemetry
        self.prefill = prefill
        self.overlap = overlap
        self._inflight: Launched | None = None
        self.carry = SamplerCarry()
        self._launches = 0
        #: steps launched while the previous step's tokens were still unread on the device
        self.launched_ahead = 0
        self._times = StepTimes()
        self._last_done = 0.0  # when the last step read was over (its tokens on the host)
        #: The disk tier's engine-thread side (engine/runner/disk_sync.py), or None.
        self.disk = None
        #: speculative decoding's drafts (engine/sched/speculation.py); the scheduler asks it
        self.speculator = speculator if speculator is not None else Speculator(enabled=False)
        self.drafting = Drafting(scheduler, output, telemetry, self.carry, self.speculator,
                                 self._fail)

    def step(self) -> None:
        """schedule -> launch -> finish the previous step (see the module's docstring)."""
        times = self._times = StepTimes()
        t0 = time.perf_counter()
        if self._inflight is not None and self._inflight.synchronous:
            self._end_inflight()  # a grammar's mask or a beam search's next tokens need it
            self.release_finished()  # what it ended gives its blocks back before planning
        self.zero_released()
        if self.disk is not None:
            self.disk.restore()  # blocks read back from disk join the prefix cache first
        budget = self.prefill.budget(self.scheduler.decoding, self.scheduler.prompt_context)
        plan = self.scheduler.schedule(budget, continue_prompts=not self.prefill.holding,
                                       free_tokens=self.prefill.free_tokens)
        if self.disk is not None:
            self.disk.save_evicted()  # before the step writes into the blocks it evicted
        self._end_failed(plan.failed)
        launched = None
        if plan.works:
            self.pool.copy_blocks(plan.copies)
            times.schedule = time.perf_counter() - t0
            launched = self._launch(plan)
            if launched is not None:
                launched.shape = StepShape.of(plan.works, t0)
                if self._inflight is not None:
                    self.launched_ahead += 1
            self.scheduler.commit(plan)
        self._end_inflight()  # the previous step
        if launched is not None:
            self._inflight = launched
            if not self.overlap:
                self._end_inflight()
        self.release_finished()
        if self.disk is not None:
            self.disk.write_through()  # a few newly cached blocks, for the writer thread
        if plan.works:
            self.telemetry.step(len(plan.works), time.perf_counter() - t0, times)

    def _observe(self, shape: StepShape, done: float) -> None:
        """Teach the prefill budget and the speculator what a step of ``shape`` costs: the
        time from when the device could start it (its own start, or the previous step's end
        when it was launched ahead of that) to when its tokens were read. Overlapped, step
        t+1 is launched before step t is read, so the wall time of one ``step()`` call holds
        step t's device time beside step t+1's plan; measured this way, each step's prompt
        tokens and drafts are paired with their own cost, and the cost is the interval the
        streaming chats see between two tokens."""
        period = done - max(shape.started, self._last_done)
        self._last_done = done
        self.prefill.observe(period, shape.decodes, shape.prompt_tokens, shape.prompt_context)
        self.speculator.observe_step(period, shape.decodes, shape.drafts, shape.prompt_tokens)

    def zero_released(self) -> None:
        """Zero the blocks incognito chats gave back, before anything can take them again
        (engine/kv/blocks.py ``to_zero``)."""
        alloc = self.scheduler.alloc
        if alloc.to_zero:
            blocks, alloc.to_zero = alloc.to_zero, []
            self.pool.zero_blocks([b for b in blocks if not alloc.refcount(b)])

    def release_finished(self) -> None:
        """The one place sequences leave the scheduler: those the output ended since the
        last call give their blocks back (at the end of a step, and after the engine
        applied its commands: a cancel)."""
        for seq in self.output.take_finished():
            self.scheduler.remove(seq)
            self.speculator.forget(seq)

    def discard_inflight(self) -> None:
        """Let the step in flight finish on the device, unread (the engine is stopping)."""
        self.carry.last = None
        self._end_inflight(accept=False)

    def _end_inflight(self, accept: bool = True) -> None:
        """The one place the step in flight ends: its tokens read and accepted, or, when
        the engine stops, waited for and dropped unread. No-op when none is in flight."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return
        if accept:
            self._read(launched)
            return
        for seq in launched.seqs:
            seq.inflight = 0
        try:
            mx.eval([a for a in (launched.tokens,) if a is not None],
                    launched.beams.arrays() if launched.beams is not None else [],
                    launched.drafts.arrays() if launched.drafts is not None else [])
        except Exception:  # its requests are being cancelled anyway
            logger.exception("the last step failed while the engine stopped")

    def _end_failed(self, failed: list[tuple[Sequence, str]]) -> None:
        """End the sequences that need more KV than the whole pool holds."""
        if any(seq.inflight for seq, _ in failed):
            self._end_inflight()  # their last token is in flight: keep it
        for seq, message in failed:
            if seq.finished:
                continue
            if seq.num_generated:
                # A reply stopped by the pool's size is a normal stop: it keeps its text.
                self.output.end_at_pool_limit(seq, self.scheduler.capacity_tokens)
            else:
                self.output.finish(seq, FinishReason.ERROR, message)

    # ---- launching ----------------------------------------------------------------------------

    def _launch(self, plan: StepPlan) -> Launched | None:
        """Build and start the step; None when it had to run (and finish) synchronously."""
        t0 = time.perf_counter()
        try:
            batch = self._feed_inflight(build_step_batch(
                plan.works, drafts_as_decodes=self.paged_model.decode_kernel,
                row_fit=self.paged_model.row_fit), plan.works)
            logits = self.paged_model.forward(batch)  # builds the lazy graph
        except Exception as e:  # the graph could not be built: isolate, synchronously
            logger.warning("step failed (%s); isolating its %d sequences", e, len(plan.works))
            self._isolate(plan)
            return None
        t1 = time.perf_counter()
        self._times.build += t1 - t0
        fanout: list[list[Sequence]] = [[] for _ in plan.works]
        seqs: list[Sequence] = []
        rows: list[SamplingRow] = []
        owners: list[int] = []
        beam_seqs: list[Sequence] = []
        beam_owners: list[int] = []
        drafting: list[int] = []  # logit rows of the works that verify drafts
        for i, owner in enumerate(batch.logit_owners):
            fanout[owner] = plan.fanout(plan.works[owner])
            seq = plan.works[owner].seq
            if plan.works[owner].drafts:  # k + 1 rows, verified together (runner/verify.py)
                drafting.append(i)
                continue
            if seq.request.beams is not None:  # a beam: ranked by its group, not sampled
                beam_owners.append(i)
                beam_seqs.append(seq)
                continue
            for s, row in self._prepare(fanout[owner]):
                owners.append(i)
                seqs.append(s)
                rows.append(row)
        drafts = self.drafting.verify(plan, batch, logits, drafting) if drafting else None
        if not rows and not beam_seqs and drafts is None:  # a prompt chunk that samples
            mx.async_eval(self.paged_model.written())  # nothing, or every row failed: its
            return None  # K/V is still written
        beams = None
        if beam_seqs:
            beams = beam_candidates(logits[mx.array(beam_owners, dtype=mx.int32)], beam_seqs,
                                    len(self.output.eos_ids))
        if not rows:
            mx.async_eval(beams.arrays() if beams is not None else [],
                          drafts.arrays() if drafts is not None else [])
            self._times.sample += time.perf_counter() - t1
            self._launches += 1
            return Launched(list(plan.works), fanout, [], [], None, None, None, None,
                            self._launches, beams=beams, drafts=drafts)
        if owners != list(range(logits.shape[0])):
            logits = logits[mx.array(owners, dtype=mx.int32)]
        raw = logits
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            logits = self._constrain(logits, [seqs[i] for i in constrained], constrained)
        layout, state = self.carry.row_state(seqs, rows, self._inflight)
        tokens, next_state = draw(layout, logits, state)
        logprobs = None
        if layout.logprob_tops is not None:
            logprobs = pending_logprobs(raw, tokens, layout.logprob_tops)
        t2 = time.perf_counter()
        mx.async_eval(tokens, [a for a in (next_state.windows, next_state.keys) if a is not None],
                      logprobs.arrays() if logprobs is not None else [],
                      beams.arrays() if beams is not None else [],
                      drafts.arrays() if drafts is not None else [])
        self._times.sample += t2 - t1
        self._times.forward += time.perf_counter() - t2  # on the CPU it runs right here
        for s in seqs:
            s.inflight += 1
        self._launches += 1
        self.carry.last = Launched(list(plan.works), fanout, seqs, rows, tokens, layout, state,
                                   next_state, self._launches, constrained=bool(constrained),
                                   logprobs=logprobs, beams=beams, drafts=drafts,
                                   host_tokens=self.overlap
                                   and self.speculator.wants_host_step(seqs))
        return self.carry.last

    def _constrain(self, logits: mx.array, seqs: list[Sequence], rows: list[int]) -> mx.array:
        """``logits`` with what each constrained row's grammar forbids at -inf (their
        matchers have consumed every token so far: their steps are never launched ahead)."""
        # one model, one tokenizer: any constrained request's Grammars fills every row
        masks = seqs[0].request.grammars.bitmasks([s.matcher for s in seqs])
        index = None if len(rows) == logits.shape[0] else mx.array(rows, dtype=mx.int32)
        return apply_bitmask(logits, index, mx.array(masks))

    def _prepare(self, fanout: list[Sequence]) -> list[tuple[Sequence, SamplingRow]]:
        """Each sequence of ``fanout`` with its sampling inputs; one that fails to prepare
        fails alone and is left out."""
        return [(s, row) for s in fanout if (row := self._guard(s, sampling_row, s)) is not None]

    def _feed_inflight(self, batch: StepBatch, works: list[SequenceWork]) -> StepBatch:
        """Put the previous step's sampled tokens (still lazy) where works feed PENDING."""
        rows, sources = [], []
        for i, w in enumerate(works):
            for j, token in enumerate(w.tokens):
                if token == PENDING:
                    rows.append(batch.work_rows[i] + j)
                    sources.append(self._inflight.row_of(w.seq))
        if not rows:
            return batch
        flat = batch.tokens.reshape(-1)
        flat[mx.array(rows, dtype=mx.int32)] = self._inflight.tokens[
            mx.array(sources, dtype=mx.int32)].astype(flat.dtype)
        return replace(batch, tokens=flat[:, None])

    # ---- reading ------------------------------------------------------------------------------

    def _read(self, launched: Launched) -> None:
        """Read a launched step's tokens (the one device-to-host transfer) and accept them."""
        t0 = time.perf_counter()
        try:
            values = launched.tokens.tolist() if launched.tokens is not None else []
            reports = launched.beams.read() if launched.beams is not None else []
            verified = launched.drafts.read() if launched.drafts is not None else []
        except Exception as e:  # the device failed: redo the step one sequence at a time
            logger.warning("step failed (%s); isolating its %d sequences", e,
                           len(launched.works))
            self._rerun(launched)
            return
        t1 = time.perf_counter()
        self._times.forward += t1 - t0
        if launched.shape is not None:
            self._observe(launched.shape, t1)
        if launched.logprobs is None:
            for seq, token in zip(launched.seqs, values):
                self._accept(seq, token)
        else:
            entries = launched.logprobs.read(values)
            for row, (seq, token) in enumerate(zip(launched.seqs, values)):
                self._accept(seq, token, entries.get(row))
        for seq, candidates in reports:
            self._report_beam(seq, candidates)
        if launched.drafts is not None:
            for seq, drafts, accepted, tokens in verified:
                self._guard(seq, self.drafting.settle, seq, drafts, accepted, tokens)
        self._times.bookkeeping += time.perf_counter() - t1

    def _report_beam(self, seq: Sequence, candidates: list[tuple[int, float]]) -> None:
        """A beam's best next tokens are known; once its whole group has reported, the group
        decides the step (a failure there fails that search alone)."""
        group = seq.request.beams
        if seq.finished or not group.report(seq, candidates):
            return
        self._guard(seq, self._step_beams, group)

    def _step_beams(self, group: BeamGroup) -> None:
        """One step of a beam search: the group ranks, the scheduler forks and prunes (the
        only place a step calls it besides schedule, commit, resolve and remove), or the
        search ends with its best hypotheses."""
        now = time.perf_counter()
        if group.first_step_time is None:
            group.first_step_time = now
        decided = group.select(self.output.eos_ids, self.output.max_context)
        if decided.done:
            self.output.finish_beam_search(group.request)
            return
        group.request.forked = True  # the beams are the request's sequences from now on
        for seq in self.scheduler.advance_beams(group, decided):
            self.telemetry.token(seq.session_id, now)

    def _accept(self, seq: Sequence, token: int, logprob=None) -> None:
        self.scheduler.resolve(seq, token)
        self._guard(seq, self.output.accept_token, seq, token, logprob)

    # ---- failure isolation: one sequence at a time ---------------------------------------------

    def _isolate(self, plan: StepPlan) -> None:
        """Run a step whose graph could not be built one work at a time, now; its samples
        are prepared after their work's forward, as a launch would have."""
        self._end_inflight()  # the works feed its tokens from the host
        self.carry.drop()
        for work in plan.works:
            self._run_alone(work, plan.fanout(work))

    def _rerun(self, launched: Launched) -> None:
        """Redo a launched step whose tokens could not be read one work at a time, each
        sample drawing with the inputs (keys included) the launch drew with."""
        self.carry.drop()  # each sequence's token is resolved as it is accepted again
        index = launched.index
        beams = {id(s) for s in launched.beams.seqs} if launched.beams is not None else set()
        for work, fanout in zip(launched.works, launched.fanout):
            if id(work.seq) in beams or work.drafts:
                self._run_alone(work, fanout)
                continue
            drawn = [(s, launched.row(s)) for s in fanout if id(s) in index]
            self._run_alone(work, fanout, drawn, launched.number)

    def _run_alone(self, work: SequenceWork, fanout: list[Sequence],
                   drawn: list[tuple[Sequence, SamplingRow]] | None = None,
                   number: int | None = None) -> None:
        """Run one work synchronously, then draw and accept a token for each sequence of
        ``fanout`` (its own and the samples forked from it); an exception fails only the
        sequences drawing from this work.

        drawn: the (sequence, row) pairs as a launch drew them (a rerun; None: prepared
        now); number: the launch whose draws they redo (None: a draw after every launch so
        far).
        """
        seq = work.seq
        if seq.finished:
            return
        work = self.drafting.alone(work)
        try:
            tokens = [seq.tokens[work.start + j] if t == PENDING else t
                      for j, t in enumerate(work.tokens)]
            batch = build_step_batch([replace(work, tokens=tokens)])
            logits = self.paged_model.forward(batch)
            mx.eval(logits if logits is not None else self.paged_model.written())
        except Exception as e:
            for s in [seq, *fanout]:
                self._fail(s, e)
            return
        if not work.want_logits:
            return
        if seq.request.beams is not None:
            reported = self._guard(seq, _beam_alone, logits[0:1], seq, len(self.output.eos_ids))
            if reported is not None:
                self._report_beam(seq, reported)
            return
        samples = drawn if drawn is not None else self._prepare(fanout)
        for s, row in samples:
            if s.finished:
                continue
            row_logits = logits[0:1]
            if s.matcher is not None:
                row_logits = self._guard(s, self._constrain, row_logits, [s], [0])
                if row_logits is None:
                    continue
            token = self._guard(s, self._sample_one, s, row_logits, row,
                                self._launches if number is None else number)
            if token is not None:
                entry = None
                if row.params.logprobs is not None:
                    entry = self._guard(s, _logprob_alone, logits[0:1], token,
                                        row.params.logprobs)
                self._accept(s, token, entry)

    def _sample_one(self, seq: Sequence, logits: mx.array, row: SamplingRow,
                    number: int) -> int:
        tokens, keys = sample_rows(logits, [row])
        mx.eval(tokens, [k for k in keys if k is not None])
        if keys[0] is not None:
            set_key(seq, keys[0], number)
        return tokens.item()

    def _guard(self, seq: Sequence, fn, *args):
        """Run per-sequence work; an exception fails that sequence only."""
        try:
            return fn(*args)
        except Exception as e:
            logger.exception("request %s failed", seq.request.request_id)
            self._fail(seq, e)
            return None

    def _fail(self, seq: Sequence, e: Exception) -> None:
        """End ``seq`` with ``e`` as its error (the others go on)."""
        self.output.finish(seq, FinishReason.ERROR, describe(e))


def _beam_alone(logits: mx.array, seq: Sequence, num_eos: int) -> list[tuple[int, float]]:
    """One beam's candidates, synchronously (a sequence run on its own)."""
    pending = beam_candidates(logits, [seq], num_eos)
    mx.eval(pending.arrays())
    return pending.read()[0][1]


def _logprob_alone(logits: mx.array, token: int, top: int):
    """One row's log-probability entry, synchronously (a sequence run on its own)."""
    pending = pending_logprobs(logits, mx.array([token], dtype=mx.int32), [top])
    return pending.read([token])[0]
