"""Choosing the next token of every row of a step at once, with mlx-lm's own filters.

One pass per step: the repetition penalty is one gather/scatter over all rows (a penalty of
1 leaves a row bit-for-bit unchanged), greedy rows share one argmax, and sampled rows are
grouped by identical filter parameters so mlx-lm's ``apply_top_p`` / ``apply_min_p`` /
``apply_top_k`` run once per group. The caller reads all tokens with one device-to-host
transfer. Every operation is row-independent, so a row's token does not depend on which
other rows share the step (tests/test_sampling.py checks it against the per-row sampler).

Seeded requests carry their own PRNG key (split once per token) instead of MLX's global
generator, so a row's draw depends only on its own logits, parameters and key, never on the
other rows (exactly: tests/test_sampling.py). The logits themselves are not batch-invariant:
the forward's matmuls round differently for another batch composition (about 6e-7 apart on
the tiny test llama), which can flip a sampled token now and then; a seeded reply replays
exactly when it runs with the same batches (tests/test_engine.py compares two engines).
Each sampled row draws with its own ``mx.random.categorical`` call on its own key: MLX has
no batched draw over per-row keys, and one batched draw with one key would change tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.config import SamplingParams


def new_key(seed: int | None, index: int) -> mx.array:
    """The PRNG key of sample ``index``: from the seed when given, else fresh entropy."""
    if seed is None:
        import secrets

        return mx.random.key(secrets.randbits(63))
    return mx.random.split(mx.random.key(seed), index + 1)[index]


@dataclass(frozen=True)
class SamplingRow:
    """What one logit row needs to be sampled: its parameters, its recent tokens (for the
    repetition penalty) and its PRNG key (None when greedy)."""

    params: SamplingParams
    history: Sequence[int]
    key: mx.array | None


def sample_rows(logits: mx.array, rows: Sequence[SamplingRow]) -> tuple[mx.array, list]:
    """Next tokens for ``logits`` [N, vocab] (lazy int32 [N]) and each row's next key.

    Nothing is evaluated here: the caller evaluates the tokens (and keys) once.
    """
    x = logits.astype(mx.float32)
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        x = _penalise_repetitions(x, rows)
    tokens = mx.argmax(x, axis=-1).astype(mx.int32)
    keys = [r.key for r in rows]
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        if not r.params.greedy:
            p = r.params
            groups.setdefault((p.temperature, p.top_p, p.min_p, p.top_k), []).append(i)
    if not groups:
        return tokens, keys
    sampled_rows: list[int] = []
    sampled: list[mx.array] = []
    for (temperature, top_p, min_p, top_k), members in groups.items():
        sub = x[mx.array(members, dtype=mx.int32)] if len(members) < len(rows) else x
        logprobs = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
        if 0.0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0.0:
            logprobs = apply_min_p(logprobs, min_p)
        if 0 < top_k < logprobs.shape[-1]:  # top_k = vocabulary size keeps every token
            logprobs = apply_top_k(logprobs, top_k)
        scaled = logprobs * (1.0 / temperature)
        for j, i in enumerate(members):
            keys[i], draw = mx.random.split(rows[i].key)
            sampled.append(mx.random.categorical(scaled[j : j + 1], key=draw)[0])
            sampled_rows.append(i)
    tokens[mx.array(sampled_rows, dtype=mx.int32)] = mx.stack(sampled).astype(mx.int32)
    return tokens, keys


def _penalise_repetitions(x: mx.array, rows: Sequence[SamplingRow]) -> mx.array:
    """mlx-lm's repetition penalty on every row at once: each row's last
    ``repetition_context_size`` tokens are divided (positive logits) or multiplied (negative)
    by its penalty. Rows are padded to the widest window by repeating a token, which rewrites
    the same value twice; a row without a penalty gets a factor of 1."""
    width = max(r.params.repetition_context_size for r in rows
                if r.params.repetition_penalty != 1.0)
    context = []
    penalties = []
    for r in rows:
        recent = list(r.history[-r.params.repetition_context_size:])
        penalties.append([r.params.repetition_penalty if recent else 1.0])
        recent = recent[-width:] or [0]
        context.append(recent + [recent[-1]] * (width - len(recent)))
    index = mx.array(context, dtype=mx.int32)
    penalty = mx.array(penalties, dtype=mx.float32)
    selected = mx.take_along_axis(x, index, axis=-1)
    selected = mx.where(selected < 0, selected * penalty, selected / penalty)
    return mx.put_along_axis(x, index, selected, axis=-1)
