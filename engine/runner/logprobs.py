"""Log-probabilities of the sampled tokens, for the rows that ask (``SamplingParams.logprobs``).

The model's own distribution: the log-softmax of a row's raw logits, before the repetition
penalty, the grammar's mask and the sampling filters (as OpenAI's ``logprobs`` report it),
computed on the device for the asking rows only and read with the step's tokens. A step
where no row asks does none of this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from engine.events import TokenLogprob


@dataclass(frozen=True)
class PendingLogprobs:
    """One step's log-probabilities on the device, for rows ``rows`` of its sampled rows."""

    rows: tuple[int, ...]
    tops: tuple[int, ...]  # alternatives each asking row wants
    chosen: mx.array  # [len(rows)]
    top_ids: mx.array | None  # [len(rows), max(tops)]
    top_values: mx.array | None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def read(self, tokens: Sequence[int]) -> dict[int, TokenLogprob]:
        """Each asking row's entry, by row (``tokens``: the step's sampled tokens, read)."""
        chosen = self.chosen.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        values = self.top_values.tolist() if self.top_values is not None else None
        out = {}
        for k, row in enumerate(self.rows):
            top: tuple[tuple[int, float], ...] = ()
            if ids is not None and self.tops[k]:
                pairs = sorted(zip(ids[k], values[k]), key=lambda p: -p[1])
                top = tuple((int(t), float(v)) for t, v in pairs[: self.tops[k]])
            out[row] = TokenLogprob(int(tokens[row]), float(chosen[k]), top)
        return out


def pending_logprobs(logits: mx.array, tokens: mx.array, tops: Sequence[int | None]
                     ) -> PendingLogprobs | None:
    """The log-probabilities of ``tokens`` ([R]) under ``logits`` ([R, V], raw), and each
    row's ``tops[i]`` most likely alternatives, for the rows whose ``tops`` is not None."""
    rows = tuple(i for i, t in enumerate(tops) if t is not None)
    if not rows:
        return None
    index = None if len(rows) == len(tops) else mx.array(rows, dtype=mx.int32)
    x = (logits if index is None else logits[index]).astype(mx.float32)
    chosen_tokens = tokens if index is None else tokens[index]
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, chosen_tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
    wanted = tuple(int(tops[i]) for i in rows)
    k = max(wanted)
    top_ids = top_values = None
    if k:
        top_ids = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(lp, top_ids, axis=-1)
    return PendingLogprobs(rows, wanted, chosen, top_ids, top_values)
