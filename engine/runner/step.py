"""One engine step: schedule -> copy -> forward -> sample -> commit, with failure isolation.

Overlapped, as mlx-lm's ``BatchGenerator``: step t+1 is built and launched
(``mx.async_eval``) with step t's sampled tokens still on the device (they are fed as
PENDING slots, engine/kv/blocks.py), and only then are step t's tokens read, emitted and
checked; the host's work hides behind the device's. A sequence that step t ends (EOS, stop
string, cancel) has had at most one more token computed, which is dropped, never emitted:
``Output.accept_token`` ignores finished sequences. A reply whose token in flight is its
last (max_tokens) is not scheduled again at all. Every step overlaps, whatever its rows'
sampling parameters: the sampler's per-row state (the repetition penalty's window of recent
tokens, seeded rows' PRNG keys) lives on the device and is carried from the step before
(``Launched.next_state``, engine/runner/sampling.py), the in-flight tokens appended lazily, so
nothing in sampling needs them on the host. That state is rebuilt only when the step's
sampled sequences change (one joins, leaves, or is rerun), from the host's tokens plus the
token in flight. A sequence counts its tokens in flight (``Sequence.inflight``: two between
step t+1's launch and step t's read), so reading step t never hides step t+1's token from
the scheduler, and every sequence decodes in every step.

A failing forward is retried one sequence at a time so that only the culprits fail; an
exception while handling one sequence (sampling, accepting its token) fails that sequence
only. Nothing here touches the allocator: forks and frees go through the scheduler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from engine.events import FinishReason
from engine.kv.block_table import PENDING
from engine.kv.pool import KVPool
from engine.runner.constraints import apply_bitmask
from engine.runner.logprobs import PendingLogprobs, pending_logprobs
from engine.runner.model_adapter import PagedModel
from engine.runner.output import Output
from engine.runner.sampling import Layout, RowState, SamplingRow, draw, host_windows, sample_rows
from engine.runner.step_batch import StepBatch, build_step_batch
from engine.runner.telemetry import StepTimes, Telemetry
from engine.sched.prefill_budget import PrefillBudget
from engine.sched.scheduler import Scheduler, StepPlan
from engine.sched.sequence import Sequence
from engine.sched.work import SequenceWork

logger = logging.getLogger(__name__)


def sampling_row(seq: Sequence) -> SamplingRow:
    """What the sampler needs from ``seq`` (per sequence, so a failure here fails it alone;
    tests patch this to inject a fault)."""
    return SamplingRow(seq.request.params, seq.tokens, seq.key)


def describe(e: Exception) -> str:
    return f"generation failed: {type(e).__name__}: {e}"


@dataclass
class Launched:
    """A step whose sampled tokens are still on the device."""

    works: list[SequenceWork]
    fanout: list[list[Sequence]]  # per work: the sequences drawing from its logits
    seqs: list[Sequence]  # one per sampled row
    rows: list[SamplingRow]  # their sampling inputs (their keys may predate ``state``'s)
    tokens: mx.array  # [len(seqs)] lazy
    layout: Layout  # the rows' sampling layout (shared by the steps with the same rows)
    state: RowState  # the rows' state before this step's draw
    next_state: RowState  # after it: this step's tokens in the windows, the keys split
    number: int  # launches counted from 1: which of two steps drew later
    constrained: bool = False  # some row was masked by its grammar: read before the next
    logprobs: PendingLogprobs | None = None  # for the rows that asked

    def row_of(self, seq: Sequence) -> int:
        return self.index[id(seq)]

    @property
    def index(self) -> dict[int, int]:
        """Row of each sequence, by id (built when first asked: only a step whose rows
        change, or that feeds or reruns rows, needs it)."""
        if not hasattr(self, "_index"):
            self._index = {id(s): i for i, s in enumerate(self.seqs)}
        return self._index

    def row(self, seq: Sequence) -> SamplingRow:
        """``seq``'s sampling inputs as this step drew them, its key included (a rerun)."""
        i = self.row_of(seq)
        if self.rows[i].key is None:
            return self.rows[i]
        return replace(self.rows[i], key=self.state.keys[self.layout.keyed.index(i)])


class StepRunner:
    def __init__(self, scheduler: Scheduler, pool: KVPool, paged_model: PagedModel,
                 output: Output, telemetry: Telemetry, prefill: PrefillBudget,
                 overlap: bool = True) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.paged_model = paged_model
        self.output = output
        self.telemetry = telemetry
        self.prefill = prefill
        self.overlap = overlap
        self._inflight: Launched | None = None
        #: the latest launched step whose rows' sampling state the next step may carry
        self._last: Launched | None = None
        self._launches = 0
        #: steps launched while the previous step's tokens were still unread on the device
        self.launched_ahead = 0
        self._times = StepTimes()

    def step(self) -> None:
        times = self._times = StepTimes()
        t0 = t_schedule = time.perf_counter()
        if self._inflight is not None and self._inflight.constrained:
            # a constrained row's mask needs its newest token: this step waits for it
            self._read(self._take_inflight())
        plan = self.scheduler.schedule(
            self.prefill.budget(self.scheduler.decoding, self.scheduler.prompt_context))
        if self._inflight is not None and any(seq.inflight for seq, _ in plan.failed):
            self._read(self._take_inflight())  # their last token is in flight: keep it
        for seq, message in plan.failed:  # it needs more KV than the whole pool holds
            if seq.finished:
                continue
            if seq.num_generated:
                # A reply stopped by the pool's size is a normal stop: it keeps its text.
                self.output.end_at_pool_limit(seq, self.scheduler.capacity_tokens)
            else:
                self.output.finish(seq, FinishReason.ERROR, message)
        launched = None
        if plan.works:
            self.pool.copy_blocks(plan.copies)
            times.schedule = time.perf_counter() - t_schedule
            launched = self._launch(plan)
            if launched is not None and self._inflight is not None:
                self.launched_ahead += 1
            self.scheduler.commit(plan)
        if self._inflight is not None:
            self._read(self._take_inflight())
        if launched is not None:
            if self.overlap:
                self._inflight = launched
            else:
                self._read(launched)
        if not plan.works:
            return
        t1 = time.perf_counter()
        decodes = sum(1 for w in plan.works if len(w.tokens) == 1)
        chunks = [w for w in plan.works if len(w.tokens) != 1]
        prompt_tokens = sum(len(w.tokens) for w in chunks)
        positions = sum(len(w.tokens) * (w.start + (len(w.tokens) - 1) / 2) for w in chunks)
        self.prefill.observe(t1 - t0, decodes, prompt_tokens,
                             positions / prompt_tokens if prompt_tokens else 0.0)
        self.telemetry.step(len(plan.works), t1 - t0, times)

    def discard_inflight(self) -> None:
        """Let the step in flight finish on the device, unread (the engine is stopping)."""
        self._last = None
        if self._inflight is not None:
            launched = self._take_inflight()
            for seq in launched.seqs:
                seq.inflight = 0
            try:
                mx.eval(launched.tokens)
            except Exception:  # its requests are being cancelled anyway
                logger.exception("the last step failed while the engine stopped")

    def _take_inflight(self) -> Launched:
        launched, self._inflight = self._inflight, None
        return launched

    # ---- launching ----------------------------------------------------------------------------

    def _launch(self, plan: StepPlan) -> Launched | None:
        """Build and start the step; None when it had to run (and finish) synchronously."""
        t0 = time.perf_counter()
        try:
            batch = self._feed_inflight(build_step_batch(plan.works), plan.works)
            logits = self.paged_model.forward(batch)  # builds the lazy graph
        except Exception as e:  # the graph could not be built: isolate, synchronously
            logger.warning("step failed (%s); isolating its %d sequences", e, len(plan.works))
            if self._inflight is not None:
                self._read(self._take_inflight())
            self._drop_carry()
            for work in plan.works:
                self._run_alone(work, None)
            return None
        t1 = time.perf_counter()
        self._times.build += t1 - t0
        fanout: list[list[Sequence]] = [[] for _ in plan.works]
        seqs: list[Sequence] = []
        rows: list[SamplingRow] = []
        owners: list[int] = []
        for i, owner in enumerate(batch.logit_owners):
            fanout[owner] = self.scheduler.fork_samples(plan.works[owner].seq)
            for s in fanout[owner]:
                row = self._guard(s, sampling_row, s)
                if row is not None:
                    owners.append(i)
                    seqs.append(s)
                    rows.append(row)
        if not rows:  # a prompt chunk that samples nothing, or every row failed to prepare
            mx.async_eval(self.paged_model.written())  # its K/V still has to be written
            return None
        if owners != list(range(logits.shape[0])):
            logits = logits[mx.array(owners, dtype=mx.int32)]
        raw = logits
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            logits = self._constrain(logits, [seqs[i] for i in constrained], constrained)
        layout, state = self._row_state(seqs, rows)
        tokens, next_state = draw(layout, logits, state)
        logprobs = None
        if layout.logprob_tops is not None:
            logprobs = pending_logprobs(raw, tokens, layout.logprob_tops)
        t2 = time.perf_counter()
        mx.async_eval(tokens, [a for a in (next_state.windows, next_state.keys) if a is not None],
                      logprobs.arrays() if logprobs is not None else [])
        self._times.sample += t2 - t1
        self._times.forward += time.perf_counter() - t2  # on the CPU it runs right here
        for s in seqs:
            s.inflight += 1
        self._launches += 1
        self._last = Launched(list(plan.works), fanout, seqs, rows, tokens, layout, state,
                              next_state, self._launches, constrained=bool(constrained),
                              logprobs=logprobs)
        return self._last

    def _constrain(self, logits: mx.array, seqs: list[Sequence], rows: list[int]) -> mx.array:
        """``logits`` with what each constrained row's grammar forbids at -inf (their
        matchers have consumed every token so far: their steps are never launched ahead)."""
        # one model, one tokenizer: any constrained request's Grammars fills every row
        masks = seqs[0].request.grammars.bitmasks([s.matcher for s in seqs])
        index = None if len(rows) == logits.shape[0] else mx.array(rows, dtype=mx.int32)
        return apply_bitmask(logits, index, mx.array(masks))

    # ---- the sampler's state, carried between steps ------------------------------------------

    def _row_state(self, seqs: list[Sequence], rows: list[SamplingRow]
                   ) -> tuple[Layout, RowState]:
        """The layout and device state of this step's rows: the previous step's, carried
        as they are, when it sampled the same sequences in the same order (a steady decode:
        no per-row work at all); else a new layout, each row's window taken from the
        previous step's when it was there, or built from the host's tokens (plus the token
        in flight, lazily), and the keys from the sequences (once the previous step's are
        written back)."""
        src = self._last
        if src is not None and src.seqs == seqs:
            return src.layout, src.next_state
        if src is not None:
            self._settle(src)
        layout = Layout(rows)
        windows = None
        if layout.width:
            previous = src.next_state.windows if src is not None else None
            if previous is not None and src.layout.width != layout.width:
                previous = None
            windows = self._windows(seqs, rows, layout.width, src, previous)
        keys = mx.stack([seqs[i].key for i in layout.keyed]) if layout.keyed else None
        return layout, RowState(windows, keys)

    def _windows(self, seqs: list[Sequence], rows: list[SamplingRow], width: int,
                 src: Launched | None, previous: mx.array | None) -> mx.array:
        """[rows, width]: a row the previous step sampled keeps its window (``previous``,
        when as wide); the others are built from the host's tokens, the newest taken from
        the step in flight when it is still there."""
        kept_from, fresh, tails, tails_from = [], [], [], []
        for i, s in enumerate(seqs):
            j = src.index.get(id(s)) if previous is not None else None
            if j is not None:
                kept_from.append(j)
                continue
            if s.inflight:  # its newest token is still on the device
                tails.append(len(fresh))
                tails_from.append(self._inflight.row_of(s))
            fresh.append(i)
        if not fresh:
            return previous[mx.array(kept_from)]
        host = host_windows([rows[i].history for i in fresh], width)
        host[tails, :-1] = host[tails, 1:]
        built = mx.array(host)
        if tails:
            built[mx.array(tails), -1] = self._inflight.tokens[mx.array(tails_from)]
        if not kept_from:
            return built
        # kept rows first, then the built ones; back into the rows' order with one gather
        order = np.empty(len(seqs), dtype=np.int32)
        fresh_mask = np.zeros(len(seqs), dtype=bool)
        fresh_mask[fresh] = True
        order[~fresh_mask] = np.arange(len(kept_from))
        order[fresh] = len(kept_from) + np.arange(len(fresh))
        both = mx.concatenate([previous[mx.array(kept_from)], built])
        return both[mx.array(order)]

    def _settle(self, launched: Launched) -> None:
        """Write ``launched``'s next keys back to its sequences (lazily): the steps after it
        stop carrying them, so a sequence's own ``key`` must continue its stream."""
        keys = launched.next_state.keys
        for k, i in enumerate(launched.layout.keyed):
            self._set_key(launched.seqs[i], keys[k], launched.number)

    @staticmethod
    def _set_key(seq: Sequence, key: mx.array, number: int) -> None:
        """``seq``'s key after draw ``number``, unless a later draw's is already there (a
        step rerun after the next one was launched must not take its key back)."""
        if number >= seq.key_from:
            seq.key = key
            seq.key_from = number

    def _drop_carry(self) -> None:
        """The next step builds its rows' state afresh (a step is being rerun or run one
        sequence at a time: what the last launch carried may no longer be its rows')."""
        if self._last is not None:
            self._settle(self._last)
            self._last = None

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
            values = launched.tokens.tolist()
        except Exception as e:  # the device failed: redo the step one sequence at a time
            logger.warning("step failed (%s); isolating its %d sequences", e,
                           len(launched.works))
            self._rerun(launched)
            return
        t1 = time.perf_counter()
        self._times.forward += t1 - t0
        if launched.logprobs is None:
            for seq, token in zip(launched.seqs, values):
                self._accept(seq, token)
        else:
            entries = launched.logprobs.read(values)
            for row, (seq, token) in enumerate(zip(launched.seqs, values)):
                self._accept(seq, token, entries.get(row))
        self._times.bookkeeping += time.perf_counter() - t1

    def _accept(self, seq: Sequence, token: int, logprob=None) -> None:
        self.scheduler.resolve(seq, token)
        self._guard(seq, self.output.accept_token, seq, token, logprob)

    def _rerun(self, launched: Launched) -> None:
        self._drop_carry()  # each sequence's token is resolved as it is accepted again
        index = launched.index
        for work, fanout in zip(launched.works, launched.fanout):
            samples = [(s, launched.row(s)) for s in fanout if id(s) in index]
            self._run_alone(work, samples, launched.number)

    def _run_alone(self, work: SequenceWork, samples: list | None,
                   number: int | None = None) -> None:
        """Run one work synchronously; an exception fails its sequences only.

        samples: the (sequence, row) pairs drawing from its logits when they were decided
        at launch (None: decide now, forking if the prompt just ended); number: the launch
        whose draws they redo (None: a draw after every launch so far).
        """
        seq = work.seq
        if seq.finished:
            return
        try:
            tokens = [seq.tokens[work.start + j] if t == PENDING else t
                      for j, t in enumerate(work.tokens)]
            batch = build_step_batch([replace(work, tokens=tokens)])
            logits = self.paged_model.forward(batch)
            mx.eval(logits if logits is not None else self.paged_model.written())
        except Exception as e:
            self.output.finish(seq, FinishReason.ERROR, describe(e))
            for s, _ in samples or []:
                self.output.finish(s, FinishReason.ERROR, describe(e))
            return
        if not work.want_logits:
            return
        if samples is None:
            samples = [(s, row) for s in self.scheduler.fork_samples(seq)
                       if (row := self._guard(s, sampling_row, s)) is not None]
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
            self._set_key(seq, keys[0], number)
        return tokens.item()

    def _guard(self, seq: Sequence, fn, *args):
        """Run per-sequence work; an exception fails that sequence only."""
        try:
            return fn(*args)
        except Exception as e:
            logger.exception("request %s failed", seq.request.request_id)
            self.output.finish(seq, FinishReason.ERROR, describe(e))
            return None


def _logprob_alone(logits: mx.array, token: int, top: int):
    """One row's log-probability entry, synchronously (a sequence run on its own)."""
    pending = pending_logprobs(logits, mx.array([token], dtype=mx.int32), [top])
    return pending.read([token])[0]
