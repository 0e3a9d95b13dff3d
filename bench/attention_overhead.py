"""Paged reference attention against contiguous mx.fast.scaled_dot_product_attention (decode).

Prints time(paged) / time(contiguous) for batch 1/4/8 and context 256/1024/4096, measured
side by side in one run. This is the bar the Metal kernel must beat on a Mac: on the CPU
backend the reference path pays for gathering the blocks into a contiguous copy.

    ./run.sh bench attention      (or: python -m bench.attention_overhead)
"""

from __future__ import annotations

import argparse
import random
import time

import mlx.core as mx

from engine.attention.dispatch import paged_decode, reference_decode

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention shape


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    return (time.perf_counter() - start) / repeats


def case(batch: int, context: int, dtype: mx.Dtype, repeats: int, use_kernel: bool):
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq + 8
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    tables = mx.array([ids[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)],
                      dtype=mx.int32)
    lens = mx.array([context] * batch, dtype=mx.int32)
    k_pool = mx.random.normal((num_blocks, BLOCK, KV_HEADS, HEAD_DIM)).astype(dtype)
    v_pool = mx.random.normal((num_blocks, BLOCK, KV_HEADS, HEAD_DIM)).astype(dtype)
    k = mx.random.normal((batch, KV_HEADS, context, HEAD_DIM)).astype(dtype)
    v = mx.random.normal((batch, KV_HEADS, context, HEAD_DIM)).astype(dtype)
    q = mx.random.normal((batch, HEADS, 1, HEAD_DIM)).astype(dtype)
    mx.eval(k_pool, v_pool, k, v, q)
    scale = HEAD_DIM**-0.5
    contiguous = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
                       repeats)
    paged = timed(lambda: paged_decode(q, k_pool, v_pool, tables, lens, scale, use_kernel),
                  repeats)
    gather = timed(lambda: reference_decode(q, k_pool, v_pool, tables, lens, scale), repeats)
    return contiguous, paged, gather


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    args = parser.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    use_kernel = mx.metal.is_available()
    backend = "Metal kernel" if use_kernel else "reference (gather) path, CPU backend"
    lines = [
        f"Decode attention, {HEADS} heads / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
        f"block {BLOCK}, {args.dtype}; paged = {backend}",
        "",
        "| batch | context | contiguous sdpa (ms) | paged (ms) | paged / contiguous |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for batch in (1, 4, 8):
        for context in (256, 1024, 4096):
            c, p, _ = case(batch, context, dtype, args.repeats, use_kernel)
            lines.append(f"| {batch} | {context} | {c * 1e3:.3f} | {p * 1e3:.3f} | {p / c:.2f}x |")
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
