"""Verifying speculative drafts: from a drafting row's k + 1 logit rows to the tokens it
keeps, with each token distributed exactly as without drafts (docs/ARCHITECTURE.md §3.13).

A sequence at length L that drafts d1..dk feeds [its last token, d1..dk] at positions
L-1..L-1+k; logit row i (0..k) is the model's next-token distribution after d1..di. Each row
is processed as the non-draft sampler would process it (engine/runner/sampling.py
``processed``: repetition penalty over the context *including* d1..di, temperature,
top-p/top-k/min-p), so p_i is the very distribution decoding without drafts would draw from
at that point, given that d1..di were accepted.

* Greedy rows keep the longest prefix of drafts equal to each row's argmax, then the argmax
  at the first mismatch (or after the last draft): the tokens of greedy decoding.
* Sampled rows use speculative sampling's rule for a point-mass draft: d_{i+1} is accepted
  with probability p_i(d_{i+1}); on rejection the token is drawn from p_i with d_{i+1}
  removed and renormalised. Then P(token = x) = p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d))
  [x != d] = p(x): exact, whatever the draft (which depends on nothing this row draws).
  After k accepted drafts the last row is drawn plainly (the bonus token).

Everything per row is computed on the device for every position at once; the host reads
two small arrays (accepted?, the token on rejection) and walks each sequence's positions.
On the CPU under top-p, the acceptance and the draw on rejection read each row's nucleus
candidates only (engine/runner/sampling.py ``Candidates``): a token outside them has
probability 0, so a draft among them is accepted or not exactly as over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.runner.sampling import Candidates, Layout, SamplingRow, inverse_cdf, processed
from engine.sched.sequence import Sequence


@dataclass
class PendingDrafts:
    """A step's drafting rows, verified on the device and not read yet."""

    seqs: list[Sequence]
    drafts: list[tuple[int, ...]]
    accept: mx.array  # bool [rows]: row i's draft (the next position's token) is accepted
    tokens: mx.array  # int32 [rows]: row i's token when its draft is not (or it has none)

    def arrays(self) -> list[mx.array]:
        return [self.accept, self.tokens]

    def read(self) -> list[tuple[Sequence, tuple[int, ...], int, list[int]]]:
        """Per sequence: its drafts, how many were accepted, and the tokens it gains (the
        accepted drafts, then the model's own token)."""
        accept = self.accept.tolist()
        tokens = self.tokens.tolist()
        out = []
        base = 0
        for seq, drafts in zip(self.seqs, self.drafts):
            m = 0
            while m < len(drafts) and accept[base + m]:
                m += 1
            out.append((seq, drafts, m, [*drafts[:m], tokens[base + m]]))
            base += len(drafts) + 1
        return out


def verify_rows(seq: Sequence, drafts: tuple[int, ...]) -> list[SamplingRow]:
    """The sampling inputs of a drafting sequence's k + 1 rows: row i's history ends with
    d1..di (its repetition penalty sees them)."""
    params = seq.request.params
    return [SamplingRow(params, [*seq.tokens, *drafts[:i]], None)
            for i in range(len(drafts) + 1)]


def verify(logits: mx.array, seqs: list[Sequence], drafts: list[tuple[int, ...]],
           key: mx.array | None = None) -> PendingDrafts:
    """Verify every drafting row of a step at once; ``logits`` holds each sequence's
    ``len(drafts) + 1`` rows, in order. Lazy: the caller evaluates ``arrays()``.

    ``key``: the key of the uniforms (None: MLX's global generator)."""
    rows = [row for seq, d in zip(seqs, drafts) for row in verify_rows(seq, d)]
    layout = Layout(rows)
    x, scaled = processed(layout, logits, layout.initial_state(rows), candidates=True)
    # the draft each row checks: the next position's token (-1: the last row has none)
    targets = mx.array([t for d in drafts for t in (*d, -1)], dtype=mx.int32)
    tokens = mx.argmax(x, axis=-1).astype(mx.int32)
    accept = tokens == targets
    if scaled is not None:
        sampled = layout.sampled
        d = targets if sampled is None else targets[sampled]
        has = d >= 0
        if isinstance(scaled, Candidates):  # the rows' distributions on their candidates
            values, ids = scaled.logprobs, scaled.tokens
            hit = (ids == d[:, None]) & has[:, None]
        else:
            values, ids = scaled, None
            hit = (mx.arange(values.shape[-1])[None, :] == d[:, None]) & has[:, None]
        probs = mx.softmax(values, axis=-1)
        q = mx.sum(mx.where(hit, probs, 0.0), axis=-1)
        uniforms = mx.random.uniform(shape=(2, values.shape[0]), key=key)
        taken = (uniforms[0] < q) & has
        residual = mx.where(hit, -mx.inf, values)
        drawn = inverse_cdf(residual, uniforms[1])
        if ids is not None:
            drawn = mx.take_along_axis(ids, drawn[:, None], axis=-1)[:, 0]
        # all the mass on the draft: nothing left to draw (and the draft was accepted
        # unless q rounded below 1 under u)
        drawn = mx.where(mx.isinf(mx.max(residual, axis=-1)), mx.maximum(d, 0), drawn)
        if sampled is None:
            accept, tokens = taken, drawn
        else:
            accept[sampled] = taken
            tokens[sampled] = drawn
    return PendingDrafts(list(seqs), list(drafts), accept, tokens)
