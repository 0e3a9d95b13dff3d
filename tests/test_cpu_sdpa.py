"""The CPU formulation of the reference attention (engine/attention/cpu_sdpa.py) against float64
numpy: its exponential, and the attention with masks, query-head groups and 8-bit scales.
The paged reference paths are tested through both formulations in tests/test_attention.py and
tests/test_kv8.py (the ``attention_formulation`` fixture)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import cpu_sdpa
from engine.attention.cpu_sdpa import fast_exp, grouped_attention


def test_fast_exp_is_mlx_exp_to_an_ulp_and_underflows_to_zero() -> None:
    x = np.concatenate([np.linspace(-100.0, 0.0, 200_001), np.linspace(0.0, 80.0, 20_001),
                        [-1e30, -88.8, -88.7, -1e-8, 0.0]]).astype(np.float32)
    got = np.array(fast_exp(mx.array(x))).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    normal = want >= np.finfo(np.float32).tiny  # float32 underflow: mx.exp gives 0 there too
    rel = np.zeros_like(want)
    rel[normal] = np.abs(got[normal] - want[normal]) / want[normal]
    # MLX's own exp is this accurate (measured: 9.1e-7 on [-16, 0], 3.9e-6 near -87, where
    # x * log2(e) in float32 carries the argument's rounding); a softmax feeds it [-16, 0]
    # for every weight that is not negligible
    assert rel[(x >= -16) & (x <= 0)].max() < 1e-6
    assert rel[normal].max() < 4e-6
    assert np.all(got[x < -88.73] == 0.0)
    # the same approximation as MLX's own exp, to within an ulp or two
    mlx_exp = np.array(mx.exp(mx.array(x))).astype(np.float64)
    assert np.max(np.abs(got[normal] - mlx_exp[normal]) / want[normal]) < 2.5e-7


def naive(q, k, v, scale, mask):
    """float64 softmax attention; q [B,H,L,D], k/v [B,KVH,T,D], mask [B,1,1,L,T] (bool)."""
    b, heads, length, d = q.shape
    group = heads // k.shape[1]
    out = np.zeros(q.shape)
    for i in range(b):
        for h in range(heads):
            s = q[i, h] @ k[i, h // group].T * scale  # [L, T]
            s = np.where(mask[i, 0, 0], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[i, h] = (p / p.sum(-1, keepdims=True)) @ v[i, h // group]
    return out


@pytest.mark.parametrize("heads,kv_heads,length", [(4, 4, 1), (9, 3, 1), (9, 3, 7), (8, 1, 5)])
def test_grouped_attention_matches_float64(heads: int, kv_heads: int, length: int) -> None:
    rng = np.random.default_rng(heads * 10 + length)
    b, tokens, d = 3, 50, 32
    q = rng.standard_normal((b, heads, length, d)).astype(np.float32)
    k = rng.standard_normal((b, kv_heads, tokens, d)).astype(np.float32) * 3
    v = rng.standard_normal((b, kv_heads, tokens, d)).astype(np.float32)
    lens = np.array([tokens, 23, length])  # ragged rows, one that sees only its own tokens
    pos = np.arange(tokens)
    query_pos = lens[:, None] - length + np.arange(length)[None, :]  # [B, L]
    mask = (pos[None, None, :] <= query_pos[:, :, None])[:, None, None]  # [B,1,1,L,T]
    got = grouped_attention(mx.array(q), mx.array(k), mx.array(v), 0.2, mx.array(mask))
    np.testing.assert_allclose(np.array(got), naive(q, k, v, 0.2, mask), atol=2e-6, rtol=1e-5)


def test_grouped_attention_folds_8bit_scales_as_dequantizing_would() -> None:
    rng = np.random.default_rng(7)
    b, heads, kv_heads, tokens, d = 2, 6, 2, 40, 16
    q = rng.standard_normal((b, heads, 1, d)).astype(np.float32)
    kq = rng.integers(-127, 128, (b, kv_heads, tokens, d)).astype(np.float32)
    vq = rng.integers(-127, 128, (b, kv_heads, tokens, d)).astype(np.float32)
    ks = (rng.random((b, kv_heads, tokens)) * 0.05).astype(np.float16)
    vs = (rng.random((b, kv_heads, tokens)) * 0.05).astype(np.float16)
    mask = np.ones((b, 1, 1, 1, tokens), bool)
    mask[1, ..., 30:] = False
    got = grouped_attention(mx.array(q), mx.array(kq), mx.array(vq), 0.25, mx.array(mask),
                            mx.array(ks), mx.array(vs))
    k = kq * ks.astype(np.float64)[..., None]
    v = vq * vs.astype(np.float64)[..., None]
    np.testing.assert_allclose(np.array(got), naive(q, k, v, 0.25, mask), atol=2e-6, rtol=1e-5)
    # a planted fault: V's scales on K is seen
    swapped = grouped_attention(mx.array(q), mx.array(kq), mx.array(vq), 0.25, mx.array(mask),
                                mx.array(vs), mx.array(ks))
    assert not np.allclose(np.array(swapped), naive(q, k, v, 0.25, mask), atol=1e-4)


def test_more_shapes_than_the_compiled_functions_kept_stay_correct() -> None:
    """Every chunk length and context is a new shape; the compiled functions are a bounded
    LRU, and a shape evicted and seen again is traced again, not served a stale graph."""
    rng = np.random.default_rng(3)
    shapes = [(length, tokens) for length in (1, 2, 3) for tokens in range(20, 20 + 30)]
    assert len(shapes) > cpu_sdpa.COMPILED_SHAPES
    for length, tokens in shapes + shapes[:5]:
        q = rng.standard_normal((1, 4, length, 8)).astype(np.float32)
        k = rng.standard_normal((1, 2, tokens, 8)).astype(np.float32)
        v = rng.standard_normal((1, 2, tokens, 8)).astype(np.float32)
        query_pos = tokens - length + np.arange(length)
        mask = (np.arange(tokens)[None, :] <= query_pos[:, None])[None, None, None]
        got = grouped_attention(mx.array(q), mx.array(k), mx.array(v), 0.3, mx.array(mask))
        np.testing.assert_allclose(np.array(got), naive(q, k, v, 0.3, mask), atol=2e-6,
                                   rtol=1e-5)
    assert cpu_sdpa._compiled.cache_info().currsize == cpu_sdpa.COMPILED_SHAPES
