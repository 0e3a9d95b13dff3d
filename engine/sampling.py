"""Choosing the next token of each sequence from its logits, with mlx-lm's own filters.

Seeded requests carry their own PRNG key (split once per token) instead of MLX's global
generator, so a seed reproduces a reply whatever else is in the batch.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from engine.config import SamplingParams


def new_key(seed: int | None, index: int) -> mx.array:
    """The PRNG key of sample ``index``: from the seed when given, else fresh entropy."""
    if seed is None:
        import secrets

        return mx.random.key(secrets.randbits(63))
    return mx.random.split(mx.random.key(seed), index + 1)[index]


def sample_next(
    logits: mx.array, params: SamplingParams, history: list[int], key: mx.array | None
) -> tuple[mx.array, mx.array | None]:
    """Next token (a lazy int32 scalar) for one sequence, and the key for its next draw.

    logits: [vocab] for this sequence's last position; history: its tokens so far.
    """
    row = logits[None].astype(mx.float32)
    if params.repetition_penalty != 1.0:
        context = mx.array(history[-64:], dtype=mx.int32)
        for processor in make_logits_processors(repetition_penalty=params.repetition_penalty):
            row = processor(context, row)
    if params.greedy:
        return mx.argmax(row, axis=-1)[0], key
    logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
    if 0.0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:  # top_k = vocabulary size keeps every token
        logprobs = apply_top_k(logprobs, params.top_k)
    key, draw = mx.random.split(key)
    token = mx.random.categorical(logprobs * (1.0 / params.temperature), key=draw)
    return token[0], key
