"""A beam search's rows in a step: each beam's best next tokens, found on the device.

Beam search ranks continuations by the model's own log-probabilities, so a beam's row is
not sampled: the log-softmax of its logits and the ``candidates_per_beam`` best entries are
computed on the device for every beam row of the step at once (one log-softmax, one
``argpartition``, one gather), evaluated with the step and read at the step's one transfer;
the host then sorts a handful of (token, log-probability) pairs per beam and the group
decides (engine/sched/beams.py). Nothing on the host walks the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from engine.sched.beams import candidates_per_beam
from engine.sched.sequence import Sequence as Seq


@dataclass(frozen=True)
class PendingBeams:
    """One step's beam rows on the device: their best tokens and log-probabilities."""

    seqs: list[Seq]
    counts: tuple[int, ...]  # candidates each row's group keeps
    ids: mx.array  # [rows, max(counts)] int32, unordered
    values: mx.array  # [rows, max(counts)] float32, the tokens' log-probabilities

    def arrays(self) -> list[mx.array]:
        return [self.ids, self.values]

    def read(self) -> list[tuple[Seq, list[tuple[int, float]]]]:
        """Each beam's candidates, best first (ties: the lower token id first)."""
        ids, values = self.ids.tolist(), self.values.tolist()
        out = []
        for seq, count, row_ids, row_values in zip(self.seqs, self.counts, ids, values):
            pairs = sorted(zip(row_ids, row_values), key=lambda p: (-p[1], p[0]))[:count]
            out.append((seq, pairs))
        return out


def beam_candidates(logits: mx.array, seqs: Sequence[Seq], num_eos: int) -> PendingBeams:
    """The best next tokens of ``logits`` ([rows, vocab], one row per beam of ``seqs``),
    lazily: as many per row as the widest group of the step keeps (each group reads its
    own number)."""
    counts = tuple(candidates_per_beam(s.request.params.beam_width, num_eos) for s in seqs)
    keep = min(max(counts), logits.shape[-1])
    x = logits.astype(mx.float32)
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    ids = mx.argpartition(-logprobs, keep - 1, axis=-1)[:, :keep]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    return PendingBeams(list(seqs), counts, ids.astype(mx.int32), values)
