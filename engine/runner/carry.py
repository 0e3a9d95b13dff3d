"""A launched step, and the sampler's per-row state carried on the device between steps.

Every step overlaps, whatever its rows' sampling parameters: the sampler's per-row state
(the repetition penalty's window of recent tokens, seeded rows' PRNG keys) lives on the
device and is carried from the step before (``Launched.next_state``,
engine/runner/sampling.py), the in-flight tokens appended lazily, so nothing in sampling
needs them on the host. That state is rebuilt only when the step's sampled sequences change
(one joins, leaves, or is rerun), from the host's tokens plus the token in flight.

Kept apart from the step (engine/runner/step.py) because it is one question with one
answer: given the rows this step samples, which state do they draw with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from engine.runner.beams import PendingBeams
from engine.runner.logprobs import PendingLogprobs
from engine.runner.sampling import Layout, RowState, SamplingRow, host_windows
from engine.runner.verify import PendingDrafts
from engine.sched.sequence import Sequence
from engine.sched.work import SequenceWork


@dataclass(frozen=True)
class StepShape:
    """What a launched step held, as the prefill budget and the speculator price it: rows
    decoding (a drafting row counts once), their draft tokens, prompt tokens and the mean
    position those attend from, and when the step started (``time.perf_counter``)."""

    decodes: int
    drafts: int
    prompt_tokens: int
    prompt_context: float
    started: float

    @staticmethod
    def of(works: list[SequenceWork], started: float) -> StepShape:
        chunks = [w for w in works if len(w.tokens) != 1 and not w.drafts]
        prompt_tokens = sum(len(w.tokens) for w in chunks)
        positions = sum(len(w.tokens) * (w.start + (len(w.tokens) - 1) / 2) for w in chunks)
        return StepShape(decodes=len(works) - len(chunks),
                         drafts=sum(len(w.drafts) for w in works),
                         prompt_tokens=prompt_tokens,
                         prompt_context=positions / prompt_tokens if prompt_tokens else 0.0,
                         started=started)


@dataclass
class Launched:
    """A step whose sampled tokens (and beam rows' candidates) are still on the device.

    A step of beam rows only samples nothing: its ``tokens``, ``layout`` and states are None
    and it is never the carry's ``last``."""

    works: list[SequenceWork]
    fanout: list[list[Sequence]]  # per work: the sequences drawing from its logits
    seqs: list[Sequence]  # one per sampled row
    rows: list[SamplingRow]  # their sampling inputs (their keys may predate ``state``'s)
    tokens: mx.array | None  # [len(seqs)] lazy (None: no sampled row)
    layout: Layout | None  # the rows' sampling layout (shared by the steps with the same rows)
    state: RowState | None  # the rows' state before this step's draw
    next_state: RowState | None  # after it: this step's tokens in the windows, the keys split
    number: int  # launches counted from 1: which of two steps drew later
    constrained: bool = False  # some row was masked by its grammar: read before the next
    logprobs: PendingLogprobs | None = None  # for the rows that asked
    #: the beam search rows' candidates: read before the next step (the groups decide what
    #: the beams feed next, on the host)
    beams: PendingBeams | None = None
    #: the drafting rows' verification (engine/runner/verify.py): read before the next step
    #: (the tokens each keeps decide what it feeds next)
    drafts: PendingDrafts | None = None
    #: some sampled row may draft next step: its newest token must be on the host by then
    host_tokens: bool = False
    #: what the step held, for the cost models that learn from its time (set at launch)
    shape: StepShape | None = None

    @property
    def synchronous(self) -> bool:
        """The next step needs this one read first: a grammar's mask needs a constrained
        row's newest token, a beam search's next tokens are decided on the host, and so are
        a drafting row's (and the drafts that follow a row's newest token)."""
        return (self.constrained or self.beams is not None or self.drafts is not None
                or self.host_tokens)

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


def set_key(seq: Sequence, key: mx.array, number: int) -> None:
    """``seq``'s key after draw ``number``, unless a later draw's is already there (a step
    rerun after the next one was launched must not take its key back)."""
    if number >= seq.key_from:
        seq.key = key
        seq.key_from = number


class SamplerCarry:
    """The latest launched step (``last``), whose rows' state the next step may carry."""

    def __init__(self) -> None:
        self.last: Launched | None = None

    def row_state(self, seqs: list[Sequence], rows: list[SamplingRow],
                  inflight: Launched | None) -> tuple[Layout, RowState]:
        """The layout and device state of this step's rows: the previous step's, carried
        as they are, when it sampled the same sequences in the same order (a steady decode:
        no per-row work at all); else a new layout, each row's window taken from the
        previous step's when it was there, or built from the host's tokens (plus the token
        in flight, from ``inflight``, lazily), and the keys from the sequences (once the
        previous step's are written back)."""
        src = self.last
        if src is not None and src.seqs == seqs:
            return src.layout, src.next_state
        if src is not None:
            settle(src)
        layout = Layout(rows)
        windows = None
        if layout.width:
            previous = src.next_state.windows if src is not None else None
            if previous is not None and src.layout.width != layout.width:
                previous = None
            windows = _windows(seqs, rows, layout.width, src, previous, inflight)
        keys = mx.stack([seqs[i].key for i in layout.keyed]) if layout.keyed else None
        return layout, RowState(windows, keys)

    def drop(self) -> None:
        """The next step builds its rows' state afresh (a step is being rerun or run one
        sequence at a time: what the last launch carried may no longer be its rows')."""
        if self.last is not None:
            settle(self.last)
            self.last = None


def settle(launched: Launched) -> None:
    """Write ``launched``'s next keys back to its sequences (lazily): the steps after it
    stop carrying them, so a sequence's own ``key`` must continue its stream."""
    keys = launched.next_state.keys
    for k, i in enumerate(launched.layout.keyed):
        set_key(launched.seqs[i], keys[k], launched.number)


def _windows(seqs: list[Sequence], rows: list[SamplingRow], width: int,
             src: Launched | None, previous: mx.array | None,
             inflight: Launched | None) -> mx.array:
    """[rows, width]: a row the previous step sampled keeps its window (``previous``, when
    as wide); the others are built from the host's tokens, the newest taken from the step
    in flight when it is still there."""
    kept_from, fresh, tails, tails_from = [], [], [], []
    for i, s in enumerate(seqs):
        j = src.index.get(id(s)) if previous is not None else None
        if j is not None:
            kept_from.append(j)
            continue
        if s.inflight:  # its newest token is still on the device
            tails.append(len(fresh))
            tails_from.append(inflight.row_of(s))
        fresh.append(i)
    if not fresh:
        return previous[mx.array(kept_from)]
    host = host_windows([rows[i].history for i in fresh], width)
    host[tails, :-1] = host[tails, 1:]
    built = mx.array(host)
    if tails:
        built[mx.array(tails), -1] = inflight.tokens[mx.array(tails_from)]
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
