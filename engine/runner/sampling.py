"""Choosing the next token of every row of a step at once, with mlx-lm's own filters.

A step's rows are described once per change of the rows (:class:`Layout`: groups, index
arrays, penalties, built from their parameters), and their device state is carried from one
step to the next (:class:`RowState`): each row's last tokens for the repetition penalty and
each seeded row's PRNG key. A step that samples the same sequences as the step before reuses
both, so drawing costs a fixed handful of MLX operations whatever the batch size, and
nothing waits on the host: the token sampled by step t is appended to the window on the
device, lazily, so step t+1 can be built (and penalised) before step t's tokens are read.
The one exception is top-p on the CPU backend (:func:`nucleus`), which evaluates the rows to
choose between its candidates and a full sort; a CPU step is evaluated layer by layer by its
attention kernel anyway. There, a step without seeded rows also draws from those candidates
only (:class:`Candidates`): every other token is at -inf, and MLX's CPU ``exp`` over a 49k
vocabulary costs about a millisecond a row.

One pass per step: the repetition penalty is one gather/scatter over all rows (a penalty of
1 leaves a row bit-for-bit unchanged), greedy rows share one argmax, sampled rows are
grouped by identical filter parameters so mlx-lm's ``apply_top_p`` / ``apply_min_p`` /
``apply_top_k`` run once per group, and every sampled row is drawn by one batched
inverse-CDF pass. The caller reads all tokens with one device-to-host transfer.

The draw. MLX's ``categorical`` on one row (what the engine used to call once per row) is an
inverse-CDF sampler: one uniform number from the row's key, scaled by the row's unnormalised
mass and searched in its exclusive cumulative sum. :func:`inverse_cdf` is that computation
on every row at once, and the uniforms come from one vmapped draw over the seeded rows' keys
(``mx.vmap`` of ``mx.random.split`` / ``mx.random.uniform`` gives the same numbers as a call
per key), so a seeded row draws exactly the token its own ``categorical`` call would
(tests/test_sampling_batched.py replays the per-row sampler). Rows without a key (unseeded
requests) take their uniforms from one call on the step's shared key, or MLX's global
generator. Every operation is row-independent, so a seeded row's token depends only on its
own logits, parameters, history and key, never on the other rows (exactly:
tests/test_sampling_batched.py). The logits themselves are not batch-invariant: the
forward's matmuls round differently for another batch composition (about 6e-7 apart on the
tiny test llama), which can flip a sampled token now and then (ARCHITECTURE §3.7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.config import SamplingParams


def new_key(seed: int, index: int) -> mx.array:
    """The PRNG key of sample ``index`` of a seeded request (unseeded samples have none:
    they draw from the step's shared key)."""
    return mx.random.split(mx.random.key(seed), index + 1)[index]


@dataclass(frozen=True)
class SamplingRow:
    """What one logit row needs to be sampled: its parameters, its tokens so far (the
    repetition penalty looks at the end) and its own PRNG key: a seeded request's stream,
    or None (greedy rows, and sampled rows that draw from the step's shared key)."""

    params: SamplingParams
    history: Sequence[int]
    key: mx.array | None


@dataclass(frozen=True)
class RowState:
    """What a step's rows carry on the device from one step to the next.

    windows: [rows, width] int32, each row's last ``width`` tokens, oldest first (None when
    no row has a penalty); keys: [keyed rows, 2] the seeded rows' next keys, in the
    layout's ``keyed`` order (None when no row has its own key)."""

    windows: mx.array | None
    keys: mx.array | None


#: One call over every key at once, the same numbers as one call per key.
_split_each = mx.vmap(mx.random.split)
_uniform_each = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))


class Layout:
    """Everything a step's sampling needs from its rows' parameters, built once per change
    of the rows (which sequences, in which order), never per step."""

    def __init__(self, rows: Sequence[SamplingRow]) -> None:
        params = [r.params for r in rows]
        self.size = len(rows)
        penalised = [p.repetition_penalty != 1.0 and len(r.history) > 0
                     for p, r in zip(params, rows)]
        #: the widest window among penalised rows (0: no penalty this step)
        self.width = max((p.repetition_context_size for p, q in zip(params, penalised) if q),
                         default=0)
        self.penalty = self.outside = None
        if self.width:
            self.penalty = mx.array([[p.repetition_penalty if q else 1.0]
                                     for p, q in zip(params, penalised)], dtype=mx.float32)
            context = np.array([p.repetition_context_size for p in params])
            if (context < self.width).any():
                # the oldest slots of a narrower window are outside it: they point at the
                # newest token instead, which rewrites one value with itself
                self.outside = mx.array(np.arange(self.width)[None, :]
                                        < (self.width - context)[:, None])
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            if not p.greedy:
                groups.setdefault((p.temperature, p.top_p, p.min_p, p.top_k), []).append(i)
        #: per filter group: its parameters and its rows (None: every row of the step)
        self.groups = [(g, None if len(m) == self.size else mx.array(m, dtype=mx.int32))
                       for g, m in groups.items()]
        order = [i for members in groups.values() for i in members]
        #: rows drawing with their own key (seeded), and with the step's shared key
        self.keyed = [i for i in order if rows[i].key is not None]
        self.shared = [i for i in order if rows[i].key is None]
        position = {row: n for n, row in enumerate(self.keyed + self.shared)}
        perm = [position[i] for i in order]
        #: where each sampled row's uniform sits in [keyed ..., shared ...]
        self.uniform_order = (None if perm == list(range(len(perm)))
                              else mx.array(perm, dtype=mx.int32))
        #: each row's ``logprobs`` (None: it reports none; all None: the step reports none)
        self.logprob_tops = (tuple(p.logprobs for p in params)
                             if any(p.logprobs is not None for p in params) else None)
        #: the sampled rows, in draw order (None: every row, in order)
        self.sampled = (None if order == list(range(self.size))
                        else mx.array(order, dtype=mx.int32))

    def initial_state(self, rows: Sequence[SamplingRow]) -> RowState:
        """The state of rows seen for the first time: windows from the host's tokens."""
        windows = None
        if self.width:
            windows = mx.array(host_windows([r.history for r in rows], self.width))
        keys = mx.stack([rows[i].key for i in self.keyed]) if self.keyed else None
        return RowState(windows, keys)


def host_windows(histories: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[rows, width] int32: each history's last ``width`` tokens, left-padded with its own
    oldest one (a repeated token is penalised once, so padding changes nothing)."""
    out = np.zeros((len(histories), width), dtype=np.int32)
    for i, history in enumerate(histories):
        recent = list(history[-width:])
        if recent:
            out[i, width - len(recent):] = recent
            out[i, : width - len(recent)] = recent[0]
    return out


def draw(layout: Layout, logits: mx.array, state: RowState,
         key: mx.array | None = None) -> tuple[mx.array, RowState]:
    """Next tokens for ``logits`` [rows, vocab] (lazy int32 [rows]) and the rows' state for
    the next step (the new tokens appended to the windows, the keys split once).

    ``key`` is the shared key of the rows without their own (None: MLX's global generator).
    Nothing is evaluated here: the caller evaluates the tokens (and the state) once.
    """
    # seeded rows draw over the whole vocabulary, as their own ``categorical`` would
    x, scaled = processed(layout, logits, state, candidates=not layout.keyed)
    tokens = mx.argmax(x, axis=-1).astype(mx.int32)
    keys = state.keys
    if scaled is not None:
        uniforms = []
        if layout.keyed:
            pairs = _split_each(keys)  # [keyed, 2 (next, draw), 2]
            keys = pairs[:, 0]
            uniforms.append(_uniform_each(pairs[:, 1])[:, 0])
        if layout.shared:
            uniforms.append(mx.random.uniform(shape=(len(layout.shared),), key=key))
        u = uniforms[0] if len(uniforms) == 1 else mx.concatenate(uniforms)
        if layout.uniform_order is not None:
            u = u[layout.uniform_order]
        if isinstance(scaled, Candidates):
            drawn = mx.take_along_axis(scaled.tokens, inverse_cdf(scaled.logprobs, u)[:, None],
                                       axis=-1)[:, 0]
        else:
            drawn = inverse_cdf(scaled, u)
        if layout.sampled is None:
            tokens = drawn
        else:
            tokens[layout.sampled] = drawn
    windows = state.windows
    if windows is not None:  # a rolled window: a stable shape, one operation per step
        windows = mx.concatenate([windows[:, 1:], tokens[:, None]], axis=1)
    return tokens, RowState(windows, keys)


def processed(layout: Layout, logits: mx.array, state: RowState, candidates: bool = False
              ) -> tuple[mx.array, mx.array | Candidates | None]:
    """Every row's logits after the repetition penalty (float32 [rows, vocab]: their argmax
    is a greedy row's token), and the sampled rows' filtered log-probabilities over their
    temperature ([sampled rows, vocab] in ``layout.sampled`` order, None when no row
    samples): the distribution a sampled row draws from is their softmax. One definition
    for the draw and for speculative verification (engine/runner/verify.py).

    ``candidates``: the sampled rows' distributions may come as :class:`Candidates` (only
    the tokens a row can draw, on the CPU under top-p) instead of whole rows."""
    x = logits.astype(mx.float32)
    if layout.width:
        x = _penalise(x, layout, state.windows)
    if not layout.groups:
        return x, None
    if candidates:
        found = _candidates(layout, x)
        if found is not None:
            return x, found
    scaled = []
    for (temperature, top_p, min_p, top_k), members in layout.groups:
        sub = x if members is None else x[members]
        logprobs = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
        if 0.0 < top_p < 1.0:
            logprobs = nucleus(logprobs, top_p)
        if min_p > 0.0:
            logprobs = apply_min_p(logprobs, min_p)
        if 0 < top_k < logprobs.shape[-1]:  # top_k = vocabulary size keeps every token
            logprobs = apply_top_k(logprobs, top_k)
        scaled.append(logprobs * (1.0 / temperature))
    return x, scaled[0] if len(scaled) == 1 else mx.concatenate(scaled)


@dataclass(frozen=True)
class Candidates:
    """Sampled rows' distributions on the few tokens each can draw: a row's top
    ``NUCLEUS_CANDIDATES`` tokens, which hold its whole top-p nucleus (:func:`processed`
    with ``candidates``). Sampling a row's softmax over them is sampling its softmax over
    the vocabulary, every other token being at -inf there; on the CPU, where MLX's ``exp``
    over a 49k vocabulary costs about a millisecond a row, a speculative verification's
    softmax and draw over 1,024 candidates cost a fiftieth of that."""

    logprobs: mx.array  # float32 [sampled rows, candidates]: as processed's, -inf outside
    tokens: mx.array  # int32 [sampled rows, candidates]: the vocabulary index of each


def _candidates(layout: Layout, x: mx.array) -> Candidates | None:
    """The sampled rows' :class:`Candidates`, or None where the whole rows are needed: off
    the CPU, a group without top-p or with min-p / top-k, or a row whose nucleus may reach
    beyond its candidates."""
    values, tokens, inside = [], [], []
    for (temperature, top_p, min_p, top_k), members in layout.groups:
        if not (0.0 < top_p < 1.0) or min_p > 0.0 or top_k > 0:
            return None
        sub = x if members is None else x[members]
        found = nucleus_candidates(sub - mx.logsumexp(sub, axis=-1, keepdims=True), top_p)
        if found is None:
            return None
        kept, ids, whole = found
        values.append(kept * (1.0 / temperature))
        tokens.append(ids)
        inside.append(whole)
    mx.eval(values, inside)
    if not all(bool(mx.all(w)) for w in inside):
        return None
    if len(values) == 1:
        return Candidates(values[0], tokens[0])
    return Candidates(mx.concatenate(values), mx.concatenate(tokens))


#: The most likely tokens of a row that :func:`nucleus` reads on the CPU before it sorts the
#: row's whole vocabulary (it must only where the nucleus is wider than this). Measured on
#: the default model's chat replies (temperature 0.3, penalty 1.15, 726 positions): the
#: top-p 0.9 nucleus held 15 tokens at the median, 180 at p90, 467 at p99, 1,045 at most;
#: finding 1,024 candidates costs what finding 256 does.
NUCLEUS_CANDIDATES = 1024


def nucleus(logprobs: mx.array, top_p: float) -> mx.array:
    """mlx-lm's ``apply_top_p`` on rows of log-probabilities: each row's nucleus kept, the
    rest set to -inf. On a GPU it is mlx-lm's function. On the CPU, MLX's sort of a 49k
    vocabulary costs about 6 ms a row (bench/sampler_bench.py), paid by every sampled row of
    every step and by every position of a speculative verification; the nucleus lies within
    the row's top ``NUCLEUS_CANDIDATES`` tokens unless the distribution is very flat. So the
    threshold is found among those candidates with mlx-lm's own arithmetic (the mass above
    each, summed from the top as its reverse cumulative sum sums it), against ``top_p``
    times a total of 1: the rows are normalised log-probabilities, and mlx-lm's own total, a
    float32 sum of the whole sorted row, drifts from 1 by up to ~1e-4 on a 49k vocabulary
    (tests/test_nucleus.py: where the two disagree, the float64 nucleus agrees with this
    one). A row whose candidates hold less than ``top_p`` takes mlx-lm's full sort.
    Deciding needs the rows' values: one evaluation, which a CPU step makes anyway before
    it samples (its attention kernel evaluates each layer).
    """
    vocab = logprobs.shape[-1]
    if mx.default_device() != mx.cpu or vocab <= NUCLEUS_CANDIDATES:
        return apply_top_p(logprobs, top_p)
    threshold, covered, _ = _nucleus_threshold(
        mx.topk(logprobs, NUCLEUS_CANDIDATES, axis=-1), top_p)
    kept = mx.where(logprobs < threshold, -float("inf"), logprobs)
    mx.eval(kept, covered)
    wide = np.flatnonzero(~np.array(covered))
    if wide.size:
        rows = mx.array(wide.astype(np.int32))
        kept[rows] = apply_top_p(logprobs[rows], top_p)
    return kept


def nucleus_candidates(logprobs: mx.array, top_p: float
                       ) -> tuple[mx.array, mx.array, mx.array] | None:
    """:func:`nucleus` on each row's top ``NUCLEUS_CANDIDATES`` tokens only (lazy): their
    log-probabilities with those outside the nucleus at -inf, their vocabulary indices, and
    whether the row's nucleus lies wholly among them (bool [rows]: its threshold is above
    the lowest candidate, so no token outside them reaches it, tied or not). None off the
    CPU and for a vocabulary no larger than the candidates."""
    if mx.default_device() != mx.cpu or logprobs.shape[-1] <= NUCLEUS_CANDIDATES:
        return None
    ids = mx.argpartition(-logprobs, NUCLEUS_CANDIDATES - 1, axis=-1)[:, :NUCLEUS_CANDIDATES]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    threshold, _, lowest = _nucleus_threshold(values, top_p)
    kept = mx.where(values < threshold, -float("inf"), values)
    return kept, ids.astype(mx.int32), (threshold > lowest)[:, 0]


def _nucleus_threshold(candidates: mx.array, top_p: float
                       ) -> tuple[mx.array, mx.array, mx.array]:
    """From each row's top log-probabilities (any order; :func:`nucleus`): the nucleus's
    smallest kept log-probability [rows, 1], by mlx-lm's arithmetic (the mass above each
    candidate, summed from the top, against ``top_p``); whether the candidates hold
    ``top_p`` of the mass [rows]; and the smallest candidate [rows, 1]."""
    top = mx.sort(candidates, axis=-1)  # ascending
    probs = mx.exp(top)
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    # every token below the candidates is dropped iff the candidates' own mass reaches top_p
    covered = (mass_above[:, :1] + probs[:, :1] >= top_p)[:, 0]
    threshold = mx.take_along_axis(top, (mass_above >= top_p).sum(axis=-1, keepdims=True),
                                   axis=-1)
    return threshold, covered, top[:, :1]


def sample_rows(logits: mx.array, rows: Sequence[SamplingRow],
                key: mx.array | None = None) -> tuple[mx.array, list]:
    """Next tokens for rows seen once (their state built from the host), and each row's
    next key (None for rows without one). The engine's steps carry the state instead."""
    layout = Layout(rows)
    tokens, state = draw(layout, logits, layout.initial_state(rows), key)
    keys = [r.key for r in rows]
    for k, i in enumerate(layout.keyed):
        keys[i] = state.keys[k]
    return tokens, keys


def _penalise(x: mx.array, layout: Layout, windows: mx.array) -> mx.array:
    """mlx-lm's repetition penalty on every row at once: each token in a row's window is
    divided (positive logit) or multiplied (negative) by its penalty, once however often it
    occurs (rewriting a value with itself); a row without a penalty gets a factor of 1."""
    index = windows
    if layout.outside is not None:
        index = mx.where(layout.outside, windows[:, -1:], windows)
    selected = mx.take_along_axis(x, index, axis=-1)
    selected = mx.where(selected < 0, selected * layout.penalty, selected / layout.penalty)
    return mx.put_along_axis(x, index, selected, axis=-1)


def inverse_cdf(logits: mx.array, u: mx.array) -> mx.array:
    """Row i's draw for the uniform number ``u[i]``, as MLX's one-row ``categorical`` makes
    it (its inverse-CDF path, mlx/random.cpp): the unnormalised weights exp(x - max) (a
    row whose max is infinite weighs its maximal entries equally), their exclusive running
    sum, and the last index whose running sum is <= u times the total."""
    m = mx.max(logits, axis=-1, keepdims=True)
    w = mx.where(mx.isinf(m), (logits == m).astype(mx.float32), mx.exp(logits - m))
    cdf = mx.cumsum(w, axis=-1, inclusive=False)
    target = u[:, None] * mx.sum(w, axis=-1, keepdims=True)
    return (mx.sum(cdf <= target, axis=-1) - 1).astype(mx.int32)
