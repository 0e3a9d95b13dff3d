"""8-bit K/V: how a token's K or V is stored in an int8 pool (issue #26).

One fp16 scale per (token, KV head), symmetric: ``q = round(x / s)`` clipped to
[-127, 127], ``s = max|x| / 127`` over the head's ``head_dim`` elements, rounded to fp16
before it divides (so the stored scale is the one that quantized). Dequantized, a value is
``q * s``: no zero point. A block is written token by token, so a scale per token is fixed
the moment its token is written; a scale per block would have to be chosen before the
block's later tokens exist. The measured choice is in docs/ARCHITECTURE.md §3.1.1
(``bench/kv8_design.py``).

The reference attention path (engine/attention/dispatch.py) and both kernels
(shaders/paged_attention.metal, .cu) dequantize the same way.
"""

from __future__ import annotations

import mlx.core as mx

#: The storage type of an 8-bit pool's K and V.
INT8 = mx.int8
#: The type of its scales, one per (block slot, KV head) in each layer, for K and for V.
SCALE_DTYPE = mx.float16
#: The largest magnitude a quantized value takes (symmetric: -127..127, never -128).
QMAX = 127.0
_F16_MAX = 65504.0


def quantize(x: mx.array) -> tuple[mx.array, mx.array]:
    """x [..., head_dim] (any float dtype) -> (int8 [..., head_dim], fp16 scales [...]).

    Rounds half to even (``mx.round``). A head whose values are all zero (or so small that
    its scale underflows fp16) gets scale 0 and stores zeros."""
    xf = x.astype(mx.float32)
    amax = mx.abs(xf).max(axis=-1, keepdims=True)
    scale = mx.minimum(amax / QMAX, _F16_MAX).astype(SCALE_DTYPE)
    s = scale.astype(mx.float32)
    q = mx.round(xf / mx.where(s > 0, s, 1.0))
    q = mx.clip(q, -QMAX, QMAX).astype(INT8)
    return q, scale[..., 0]


def dequantize(q: mx.array, scales: mx.array, dtype: mx.Dtype) -> mx.array:
    """int8 [..., head_dim] and scales [...] -> ``dtype`` [..., head_dim] (``q * s`` in fp32,
    then rounded once to ``dtype``)."""
    out = q.astype(mx.float32) * scales.astype(mx.float32)[..., None]
    return out if dtype == mx.float32 else out.astype(dtype)


def _quantize_pair(keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
    kq, ks = quantize(keys)
    vq, vs = quantize(values)
    return kq, ks, vq, vs


#: (k_q, k_scales, v_q, v_scales) of a layer's rows: ``quantize`` for K and V as one compiled
#: graph (its elementwise ops fused: on an H100 a step's 8-bit writes took 2.5 ms against
#: 5.2 ms op by op, storing the same bytes; scripts/gpu/kv_write_cost.py). Traced once per
#: row shape and dtype.
quantize_kv = mx.compile(_quantize_pair)
