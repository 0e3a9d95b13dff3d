"""Issue #26, design choice: which int8 scheme for the KV pool, measured on the default model.

    python -m bench.kv8_design

Runs the embedded model over a fixed public-domain text (bench/texts/kjv_ruth.txt) with its
K/V fake-quantized as each scheme would store them (quantize, then dequantize, in
``update_and_fetch``), and reports the perplexity and the K/V reconstruction error of each:

* ``token-sym``: one fp16 scale per (token, KV head), symmetric, round to nearest;
* ``token-asym``: a scale and a zero point per (token, KV head), 255 levels;
* ``block-sym`` / ``block-asym``: one scale (and zero point) per (16-token block, KV head),
  computed over the whole block after the fact. This is optimistic: a pool written token by
  token would have to fix a block's scale before the block's later tokens arrive (or
  re-quantize the block on every write), so the real per-block error can only be larger.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from engine.models.resolve import load_model

TEXT = Path(__file__).parent / "texts" / "kjv_ruth.txt"
BLOCK = 16


def fake_quant(x: mx.array, scheme: str) -> mx.array:
    """x [B, kvh, T, D] -> the values a pool of ``scheme`` would give back."""
    if scheme == "none":
        return x
    xf = x.astype(mx.float32)
    b, h, t, d = xf.shape
    per_block = scheme.startswith("block")
    if per_block:
        pad = (-t) % BLOCK
        if pad:
            xf = mx.concatenate([xf, mx.repeat(xf[:, :, -1:], pad, axis=2)], axis=2)
        xf = xf.reshape(b, h, -1, BLOCK * d)
    if scheme.endswith("asym"):
        lo = xf.min(axis=-1, keepdims=True)
        hi = xf.max(axis=-1, keepdims=True)
        s = ((hi - lo) / 255.0).astype(mx.float16).astype(mx.float32)
        s = mx.maximum(s, 1e-8)
        z = mx.round(-lo / s) - 128  # int8 zero point: lo maps to -128
        qv = mx.clip(mx.round(xf / s) + z, -128, 127)
        y = (qv - z) * s
    else:
        s = (mx.abs(xf).max(axis=-1, keepdims=True) / 127.0).astype(mx.float16)
        s = mx.maximum(s.astype(mx.float32), 1e-8)
        y = mx.clip(mx.round(xf / s), -127, 127) * s
    if per_block:
        y = y.reshape(b, h, -1, d)[:, :, :t]
    return y.astype(x.dtype)


class FakeQuantCache(KVCache):
    def __init__(self, scheme: str, errors: list) -> None:
        super().__init__()
        self.scheme = scheme
        self.errors = errors

    def update_and_fetch(self, keys, values):
        kq, vq = fake_quant(keys, self.scheme), fake_quant(values, self.scheme)
        for a, b in ((keys, kq), (values, vq)):
            num = mx.sqrt(mx.sum((a - b).astype(mx.float32) ** 2))
            den = mx.sqrt(mx.sum(a.astype(mx.float32) ** 2))
            self.errors.append((num / den).item())
        return super().update_and_fetch(kq, vq)


def perplexity(model, tokens: list[int], scheme: str) -> tuple[float, float]:
    errors: list[float] = []
    cache = [FakeQuantCache(scheme, errors) for _ in model.layers]
    x = mx.array(tokens[:-1])[None]
    logits = model(x, cache=cache).astype(mx.float32)[0]
    lse = mx.logsumexp(logits, axis=-1)
    picked = mx.take_along_axis(logits, mx.array(tokens[1:])[:, None], axis=-1)[:, 0]
    nll = mx.mean(lse - picked).item()
    return math.exp(nll), float(np.mean(errors)) if errors else 0.0


def main() -> None:
    loaded = load_model("default")
    tokens = loaded.tokenizer.encode(TEXT.read_text())
    print(f"{loaded.name}, {loaded.dtype}, {len(tokens)} tokens of {TEXT.name}")
    base = None
    print("| scheme | perplexity | vs none | K/V relative error (mean over layers) |")
    print("| --- | --- | --- | --- |")
    for scheme in ("none", "token-sym", "token-asym", "block-sym", "block-asym"):
        ppl, err = perplexity(loaded.model, tokens, scheme)
        base = base or ppl
        print(f"| {scheme} | {ppl:.4f} | {ppl / base - 1:+.3%} | {err:.4%} |")


if __name__ == "__main__":
    main()
