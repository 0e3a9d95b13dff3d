"""Issue #26 on the GPU: what a decode step's K/V writes cost, 16-bit pool against 8-bit.

    python3 scripts/gpu/kv_write_cost.py [--rows 64] [--repeats 30] [--shape 8B] [--blocks 4096]

One step's writes into every layer, ``--rows`` tokens a layer at the bench's 8B shape,
evaluated once after all layers as the engine's step is. Variants, interleaved repeat by
repeat:

* ``bf16``: a bf16 pool's two scatters a layer (``KVPool.write``);
* ``int8-ops``: an 8-bit pool quantized op by op (``int8.quantize`` for K, then for V, each a
  dozen MLX ops) and four scatters: the engine's write before the kernel;
* ``int8-compiled``: the same under ``mx.compile`` (``int8.quantize_kv``: what
  ``KVPool.write`` does now, the engine's write off CUDA's kernel path);
* ``int8-kernel`` (CUDA only): one ``kv_quantize`` launch for K and V
  (engine/attention/kv_write.py) and the four scatters: the engine's write on CUDA until the
  in-place stores, and still where the attention kernels do not serve a layer;
* ``bf16-store``, ``int8-store`` (CUDA only): one in-place ``kv_store`` / ``kv_store_q8``
  launch a layer (``kv_write.store_kv``), the engine's write on CUDA's kernel path now.

The time is the host's, from the first write's graph to the evaluated pools: what a step
waits for. Medians with the spread; every 8-bit variant must store the same bytes.
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
from engine.attention import kv_write  # noqa: E402
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

    def ops(pool, layer, keys, values):
        kq, ks = int8.quantize(keys)
        vq, vs = int8.quantize(values)
        pool.write_quantized(layer, blk, off, kq, ks, vq, vs)

    def kernel(pool, layer, keys, values):
        pool.write_quantized(layer, blk, off, *kv_write.quantize_kv_cuda(keys, values))

    scale = mx.array([0.125], dtype=mx.float32)

    def store(pool, layer, keys, values):
        return kv_write.store_kv(keys, values, blk, off, pool.keys[layer], pool.values[layer],
                                 scale, *pool.scales(layer))

    def plain(pool, layer, keys, values):
        pool.write(layer, blk, off, keys, values)

    writers = {"bf16": plain, "int8-ops": ops, "int8-compiled": plain}
    if mx.cuda.is_available():
        writers.update({"int8-kernel": kernel, "bf16-store": store, "int8-store": store})
    pools = {}
    for name in writers:
        kv = KVShape(num_layers=layers, num_kv_heads=kvh, head_dim=d, dtype=mx.bfloat16,
                     quantized=name.startswith("int8-"))
        pools[name] = KVPool(kv, num_blocks=blocks, block_size=BLOCK_SIZE)
        mx.eval(pools[name].arrays())
    rng = np.random.default_rng(0)
    slots = rng.choice(blocks * BLOCK_SIZE, args.rows, replace=False)
    blk = mx.array((slots // BLOCK_SIZE).astype(np.int32))
    off = mx.array((slots % BLOCK_SIZE).astype(np.int32))
    keys = [mx.random.normal((args.rows, kvh, d)).astype(mx.bfloat16) for _ in range(layers)]
    values = [mx.random.normal((args.rows, kvh, d)).astype(mx.bfloat16) for _ in range(layers)]
    mx.eval(keys, values, blk, off)

    def step(name: str) -> float:
        pool, write = pools[name], writers[name]
        t0 = time.perf_counter()
        stored = [write(pool, layer, keys[layer], values[layer]) for layer in range(layers)]
        mx.eval([s for s in stored if s is not None], pool.arrays())
        return (time.perf_counter() - t0) * 1e3

    for _ in range(3):
        for name in pools:
            step(name)
    base = pools["int8-ops"]
    same = {name: all(bool(mx.array_equal(x[blk, off], y[blk, off]))
                      for xs, ys in ((base.keys, pool.keys), (base.values, pool.values),
                                     (base.k_scales, pool.k_scales),
                                     (base.v_scales, pool.v_scales))
                      for x, y in zip(xs, ys, strict=True))
            for name, pool in pools.items() if name.startswith("int8-") and pool is not base}
    if "bf16-store" in pools:
        same["bf16-store"] = all(
            bool(mx.array_equal(x[blk, off], y[blk, off]))
            for xs, ys in ((pools["bf16"].keys, pools["bf16-store"].keys),
                           (pools["bf16"].values, pools["bf16-store"].values))
            for x, y in zip(xs, ys, strict=True))
    times = {name: [] for name in pools}
    for _ in range(args.repeats):
        for name in pools:
            times[name].append(step(name))
    print(f"{args.shape}: {layers} layers x {args.rows} rows, {mx.default_device()}; "
          f"the same bytes as int8-ops (bf16-store: as bf16): {same}")
    for name, ts in times.items():
        ratio = [x / y for x, y in zip(ts, times["bf16"], strict=True)]
        print(f"  {name:>13}: {statistics.median(ts):.3f} ms ({min(ts):.3f}-{max(ts):.3f}), "
              f"/ bf16 {statistics.median(ratio):.2f}x")


if __name__ == "__main__":
    main()
