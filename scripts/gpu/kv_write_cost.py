"""Issue #26 on the GPU: what a decode step's K/V writes cost, 16-bit pool against 8-bit.

    python3 scripts/gpu/kv_write_cost.py [--rows 64] [--repeats 30] [--shape 8B] [--blocks 4096]

One step's writes into every layer (``KVPool.write``: two scatters a layer into a bf16 pool;
in an 8-bit pool ``int8.quantize``'s ops for K and V and four scatters), ``--rows`` tokens a
layer at the bench's 8B shape, evaluated once after all layers as the engine's step is.
Variants, interleaved repeat by repeat: the bf16 pool, the 8-bit pool as the engine writes
it, and the 8-bit pool with ``int8.quantize`` under ``mx.compile`` (its elementwise ops
fused). The time is the host's, from the first write's graph to the evaluated pools: what a
step waits for. Medians with the spread; the compiled quantizer must store the same bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu_bench import BLOCK_SIZE, SHAPES  # noqa: E402
from engine.kv import int8  # noqa: E402
from engine.kv.pool import KVPool, KVShape  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--shape", default="8B")
    parser.add_argument("--blocks", type=int, default=4096, help="pool blocks (16 tokens)")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    layers, kvh, d = (shape["num_hidden_layers"], shape["num_key_value_heads"],
                      shape["head_dim"])
    blocks = args.blocks
    pools = {}
    for name, quantized in (("bf16", False), ("int8", True), ("int8-compiled", True)):
        kv = KVShape(num_layers=layers, num_kv_heads=kvh, head_dim=d, dtype=mx.bfloat16,
                     quantized=quantized)
        pools[name] = KVPool(kv, num_blocks=blocks, block_size=BLOCK_SIZE)
        mx.eval(pools[name].arrays())
    compiled = mx.compile(int8.quantize)
    rng = np.random.default_rng(0)
    slots = rng.choice(blocks * BLOCK_SIZE, args.rows, replace=False)
    blk = mx.array((slots // BLOCK_SIZE).astype(np.int32))
    off = mx.array((slots % BLOCK_SIZE).astype(np.int32))
    keys = [mx.random.normal((args.rows, kvh, d)).astype(mx.bfloat16) for _ in range(layers)]
    values = [mx.random.normal((args.rows, kvh, d)).astype(mx.bfloat16) for _ in range(layers)]
    mx.eval(keys, values, blk, off)

    def step(name: str) -> float:
        pool = pools[name]
        original = int8.quantize
        if name == "int8-compiled":
            int8.quantize = compiled
        try:
            t0 = time.perf_counter()
            for layer in range(layers):
                pool.write(layer, blk, off, keys[layer], values[layer])
            mx.eval(pool.arrays())
            return (time.perf_counter() - t0) * 1e3
        finally:
            int8.quantize = original

    for _ in range(3):
        for name in pools:
            step(name)
    a, b = pools["int8"], pools["int8-compiled"]
    same = all(bool(mx.array_equal(x[blk, off], y[blk, off]))
               for xs, ys in ((a.keys, b.keys), (a.values, b.values),
                              (a.k_scales, b.k_scales), (a.v_scales, b.v_scales))
               for x, y in zip(xs, ys, strict=True))
    times = {name: [] for name in pools}
    for _ in range(args.repeats):
        for name in pools:
            times[name].append(step(name))
    print(f"{args.shape}: {layers} layers x {args.rows} rows, {mx.default_device()}; "
          f"compiled quantizer stores the same bytes: {same}")
    for name, ts in times.items():
        ratio = [x / y for x, y in zip(ts, times["bf16"], strict=True)]
        print(f"  {name:>13}: {statistics.median(ts):.3f} ms ({min(ts):.3f}-{max(ts):.3f}), "
              f"/ bf16 {statistics.median(ratio):.2f}x")


if __name__ == "__main__":
    main()
