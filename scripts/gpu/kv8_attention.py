"""Issue #26 on the H200: the 8-bit paged decode kernel against the 16-bit one.

    python3 scripts/gpu/kv8_attention.py [--repeats N] [--json PATH]

All 32 (8B) or 16 (1B) layers' decode attention of one step, 64 sequences x 2048 tokens, bf16
queries: the CUDA kernel over a bf16 pool and over an int8 pool with fp16 scales (the same
random K/V, quantized by engine/kv/int8.py), interleaved repeats, medians and spread; and the
8-bit kernel's error against the 8-bit reference path. Target: 8-bit <= 0.65x the 16-bit
kernel's time at the 8B shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu_bench import BLOCK_SIZE, SHAPES  # noqa: E402
from engine.attention.dispatch import paged_decode, reference_decode  # noqa: E402
from engine.kv import int8  # noqa: E402


def timed(fn) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def case(shape: dict, batch: int, context: int, repeats: int) -> dict:
    layers = shape["num_hidden_layers"]
    h, kvh, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    nb = -(-context // BLOCK_SIZE)
    rng = np.random.default_rng(1)
    tables = mx.array(rng.permutation(batch * nb).reshape(batch, nb).astype(np.int32))
    lens = mx.array(np.full(batch, context, np.int32))
    scale = d**-0.5
    full, q8 = [], []
    for _ in range(layers):
        k = mx.random.normal((batch * nb, BLOCK_SIZE, kvh, d)).astype(mx.bfloat16)
        v = mx.random.normal((batch * nb, BLOCK_SIZE, kvh, d)).astype(mx.bfloat16)
        q = mx.random.normal((batch, h, 1, d)).astype(mx.bfloat16)
        kq, ks = int8.quantize(k)
        vq, vs = int8.quantize(v)
        mx.eval(k, v, q, kq, ks, vq, vs)
        full.append((q, k, v))
        q8.append((q, kq, vq, ks, vs))

    def run16():
        return [paged_decode(q, k, v, tables, lens, scale, use_kernel=True) for q, k, v in full]

    def run8():
        return [paged_decode(q, k, v, tables, lens, scale, use_kernel=True, k_scales=ks,
                             v_scales=vs) for q, k, v, ks, vs in q8]

    q, kq, vq, ks, vs = q8[0]
    out = paged_decode(q, kq, vq, tables, lens, scale, use_kernel=True, k_scales=ks, v_scales=vs)
    ref = reference_decode(q, kq, vq, tables, lens, scale, k_scales=ks, v_scales=vs)
    err = float(mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))))
    for _ in range(3):
        timed(run16)
        timed(run8)
    t16, t8 = [], []
    for _ in range(repeats):  # interleaved
        t16.append(timed(run16))
        t8.append(timed(run8))
    ratios = [b / a for a, b in zip(t16, t8, strict=True)]
    return dict(batch=batch, context=context, layers=layers,
                ms16=statistics.median(t16), ms8=statistics.median(t8),
                ratio=statistics.median(ratios), ratio_lo=min(ratios), ratio_hi=max(ratios),
                max_abs_err_vs_reference=err)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = {}
    for name in ("1B", "8B"):
        rows[name] = r = case(SHAPES[name], 64, 2048, args.repeats)
        print(f"{name}: 16-bit {r['ms16']:.3f} ms, 8-bit {r['ms8']:.3f} ms, 8/16 "
              f"{r['ratio']:.3f} ({r['ratio_lo']:.3f}-{r['ratio_hi']:.3f}), 8-bit kernel vs "
              f"reference max abs err {r['max_abs_err_vs_reference']:.2e}", flush=True)
    verdict = "met" if rows["8B"]["ratio"] <= 0.65 else "NOT met"
    print(f"kv8-attention: 8B 8-bit/16-bit {rows['8B']['ratio']:.3f} (target <= 0.65: {verdict})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
