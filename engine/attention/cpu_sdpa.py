"""The reference path's attention on MLX's CPU backend: one matmul per KV head and a softmax
whose exponential is a polynomial that ``mx.compile`` fuses into one loop.

Why not ``mx.fast.scaled_dot_product_attention`` there: on the CPU backend it is not a fused
kernel but matmul, softmax, matmul, and ``mx.exp`` (inside ``mx.softmax``) runs as a scalar
loop at about 25 ns an element on our x86 machines: 200 ms for the 8.4 M scores of a 12-token
chunk over 2,600 tokens of context in the default model's 30 layers, against 40 ms for its two
matmuls. That made long-context chunks and drafted verify rows cost several decode rows each
(issues #24 and #28). ``fast_exp`` computes the same approximation ``mx.exp`` does (reduce to
``2**n * 2**f``, a degree-6 polynomial for ``2**f`` on ``|f| <= 1/2``, ``2**n`` written into
the exponent bits; within 1.2e-7 relative of it) as array operations that ``mx.compile`` fuses
with the max subtraction, the mask and an 8-bit pool's scales into one pass over the scores.

The rest of the formulation saves passes too, which matters on a machine whose memory moves a
few GB/s:

* grouped-query attention without repeating K/V: q's ``G = heads / kv_heads`` heads of one KV
  head become ``G * L`` rows of one matmul against that head's K;
* the softmax's normalisation is applied to the output (``[.., G*L, D]``), not to the weights
  (``[.., G*L, T]``);
* an 8-bit pool's K scale multiplies the scores and its V scale the weights (one value per
  token each), so K/V are only widened from int8, never multiplied out.

On a GPU backend the reference path keeps MLX's fused SDPA (engine/attention/dispatch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import mlx.core as mx

_LOG2E = 1.4426950408889634
#: 1.5 * 2**23: adding it to a float32 of magnitude < 2**22 rounds it to an integer, which
#: then sits in the low mantissa bits of the sum (``_MAGIC_BITS`` + n).
_MAGIC = 12582912.0
_MAGIC_BITS = 0x4B400000
#: Below this, exp underflows float32 (as ``mx.exp`` does, the result is exactly 0).
_UNDERFLOW = -88.72283935546875
#: A masked score: far below any real one, and exp(_MASKED - max) is exactly 0.
_MASKED = -1e30


def fast_exp(x: mx.array) -> mx.array:
    """``exp(x)`` for float32 ``x``, within 1.2e-7 relative of ``mx.exp``: 0 below -88.7
    (float32 underflow), finite for inputs up to 87 (a softmax feeds it values <= 0)."""
    t = mx.clip(x * _LOG2E, -126.0, 126.0)
    rounded = t + _MAGIC  # round(t) in the low mantissa bits
    n = rounded - _MAGIC
    f = t - n  # in [-1/2, 1/2]
    p = 1.535336188319500e-4
    p = p * f + 1.339887440266574e-3
    p = p * f + 9.618437357674640e-3
    p = p * f + 5.550332471162809e-2
    p = p * f + 2.402264791363012e-1
    p = p * f + 6.931472028550421e-1
    p = p * f + 1.0
    two_to_n = ((rounded.view(mx.int32) - (_MAGIC_BITS - 127)) << 23).view(mx.float32)
    return mx.where(x < _UNDERFLOW, 0.0, p * two_to_n)


def _weights(scores: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    """Unnormalised softmax weights of float32 ``scores`` over the last axis, 0 where ``mask``
    is False, and their sums (keepdims)."""
    s = mx.where(mask, scores, _MASKED)
    e = fast_exp(s - mx.max(s, axis=-1, keepdims=True))
    return e, mx.sum(e, axis=-1, keepdims=True)


def _weights_int8(scores: mx.array, mask: mx.array, k_scales: mx.array,
                  v_scales: mx.array) -> tuple[mx.array, mx.array]:
    """``_weights`` of scores taken against int8 K (``k_scales`` applied here), the weights
    multiplied by V's scales (the sums are not: they normalise the dequantized weights)."""
    s = mx.where(mask, scores * k_scales, _MASKED)
    e = fast_exp(s - mx.max(s, axis=-1, keepdims=True))
    return e * v_scales, mx.sum(e, axis=-1, keepdims=True)


#: Compiled weight functions kept, one per shape: a step's chunks and verify rows come in
#: every (length, context) there is, and one compiled function would keep a traced graph
#: for each shape it ever saw for the life of the engine (MLX's compile cache has no
#: bound). An evicted function takes its graph with it; a shape seen again is traced again
#: (1-3 ms, once for all layers of a step). ``mx.compile(shapeless=True)`` is not the way
#: out (mlx 0.32.4): it cannot trace ``fast_exp``'s bit cast (``View``), and with the cast
#: replaced by power-of-two multiplies it ran 2x slower (a 256-token chunk over 2,600 tokens)
#: and crashed on the broadcast masks.
COMPILED_SHAPES = 64


@lru_cache(maxsize=COMPILED_SHAPES)
def _compiled(int8_scales: bool, shapes: tuple[tuple[int, ...], ...]) -> Callable:
    return mx.compile(_weights_int8 if int8_scales else _weights)


def grouped_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
) -> mx.array:
    """softmax(q k^T * scale, masked) v with ``heads / kv_heads`` query heads per KV head.

    q: [B, H, L, D]; k, v: [B, kvh, T, D], of q's dtype, or float32 widened from an 8-bit pool
    with ``k_scales`` / ``v_scales`` [B, kvh, T] (any float dtype); mask: bool, broadcastable
    to [B, 1, 1, L, T] (True: attend), at least one True per query row. Returns [B, H, L, D].
    """
    b, heads, length, d = q.shape
    kv_heads, tokens = k.shape[1], k.shape[2]
    group = heads // kv_heads
    rows = (q * scale).reshape(b, kv_heads, group * length, d)
    scores = (rows @ mx.swapaxes(k, -1, -2)).astype(mx.float32)
    scores = scores.reshape(b, kv_heads, group, length, tokens)
    if k_scales is None:
        weights, sums = _compiled(False, (scores.shape, mask.shape))(scores, mask)
    else:
        per_token = (b, kv_heads, 1, 1, tokens)
        weights, sums = _compiled(True, (scores.shape, mask.shape))(
            scores, mask, k_scales.astype(mx.float32).reshape(per_token),
            v_scales.astype(mx.float32).reshape(per_token))
    weights = weights.reshape(b, kv_heads, group * length, tokens).astype(v.dtype)
    out = (weights @ v).astype(mx.float32) / sums.reshape(b, kv_heads, group * length, 1)
    return out.reshape(b, heads, length, d).astype(q.dtype)
