"""What decode groups save on the reference attention path (engine/runner/step_batch.py).

Part 1, calibration: one reference decode-attention call of R rows over W blocks, for a
grid of R and W, at the loaded model's attention shape; a least-squares fit of
``t = call + per_row_block * R * W`` gives what one more call is worth in gathered
row-blocks (``GROUP_CALL_BLOCKS``).

Part 2, the issue's mixed step: seven chats decoding at ``--short`` tokens of context and one
at ``--long``, through the whole model (every layer), with decode groups and with every
row padded to the longest table (one group), interleaved A B A B, median and min-max; and a
step of the seven short chats alone for scale.

    source scripts/env.sh; .venv/bin/python bench/decode_groups_cost.py [--model default]
        [--short 100] [--long 3600] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import engine.runner.step_batch as step_batch  # noqa: E402
from engine.attention.dispatch import reference_decode  # noqa: E402
from engine.kv.pool import KVPool  # noqa: E402
from engine.models.resolve import load_model  # noqa: E402
from engine.runner.architecture import probe_kv_shape  # noqa: E402
from engine.runner.model_adapter import PagedModel  # noqa: E402
from engine.runner.step_batch import build_step_batch  # noqa: E402
from engine.sched.work import SequenceWork  # noqa: E402

BLOCK = 16


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def calibrate(pool: KVPool, heads: int, repeats: int) -> tuple[float, float]:
    """(seconds per call, seconds per row-block) of reference decode attention."""
    k, v = pool.keys[0], pool.values[0]
    d = pool.shape.head_dim
    xs, ys = [], []
    for rows in (1, 4, 16):
        for width in (2, 8, 32, 128):
            q = mx.random.normal((rows, heads, 1, d)).astype(pool.shape.dtype)
            tables = mx.array(np.arange(rows * width).reshape(rows, width) % pool.num_blocks,
                              dtype=mx.int32)
            lens = mx.full((rows,), width * BLOCK, dtype=mx.int32)
            t = statistics.median(timed(
                lambda q=q, tables=tables, lens=lens: mx.eval(
                    reference_decode(q, k, v, tables, lens, d**-0.5)), repeats))
            xs.append(rows * width)
            ys.append(t)
            print(f"  rows {rows:3d} x {width:4d} blocks: {t * 1e3:7.3f} ms")
    # relative errors weigh alike: the widest calls leave the caches and would drown the rest
    per_rb, call = np.polyfit(xs, ys, 1, w=1 / np.asarray(ys))
    return float(call), float(per_rb)


def mixed_works(short: int, long: int, shorts: int = 7) -> list[SequenceWork]:
    works, next_block = [], 0
    for ctx in [short] * shorts + ([long] if long else []):
        nb = -(-ctx // BLOCK)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        last = ctx - 1
        works.append(SequenceWork([1], last, table, [(table[last // BLOCK], last % BLOCK)]))
    return works


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--short", type=int, default=100)
    ap.add_argument("--long", type=int, default=3600)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    loaded = load_model(args.model)
    model = loaded.model
    shape = probe_kv_shape(model)
    blocks = 7 * -(-args.short // BLOCK) + -(-args.long // BLOCK) + 8
    pool = KVPool(shape, max(blocks, 16 * 128), BLOCK)
    for layer in range(shape.num_layers):  # K/V of some scale, as a real pool holds
        pool.keys[layer] = mx.random.normal(pool.keys[layer].shape).astype(shape.dtype)
        pool.values[layer] = mx.random.normal(pool.values[layer].shape).astype(shape.dtype)
    mx.eval(pool.keys, pool.values)
    paged = PagedModel(model, pool, use_kernel=False)
    heads = model.args.num_attention_heads
    print(f"model {args.model}: {shape.num_layers} layers, {heads} heads, "
          f"{shape.num_kv_heads} kv heads, head_dim {shape.head_dim}, {shape.dtype}")

    print("part 1: one reference decode-attention call")
    call, per_rb = calibrate(pool, heads, args.repeats)
    print(f"  fit: {call * 1e6:.1f} us per call + {per_rb * 1e6:.3f} us per row-block: "
          f"a call is worth {call / per_rb:.0f} row-blocks "
          f"(GROUP_CALL_BLOCKS = {step_batch.GROUP_CALL_BLOCKS})")

    print(f"part 2: one step of 7 chats at {args.short} tokens beside one at {args.long}")
    mixed = mixed_works(args.short, args.long)
    alone = mixed_works(args.short, 0)

    def step(works, one_group: bool) -> None:
        saved = step_batch.GROUP_CALL_BLOCKS
        step_batch.GROUP_CALL_BLOCKS = 10**12 if one_group else saved
        try:
            batch = build_step_batch(works)
        finally:
            step_batch.GROUP_CALL_BLOCKS = saved
        mx.eval(paged.forward(batch), pool.keys, pool.values)

    sides = {"grouped": [], "padded": [], "short chats alone": []}
    for _ in range(args.repeats):  # interleaved
        sides["grouped"] += timed(lambda: step(mixed, False), 1)
        sides["padded"] += timed(lambda: step(mixed, True), 1)
        sides["short chats alone"] += timed(lambda: step(alone, False), 1)
    for name, ts in sides.items():
        print(f"  {name:18s} median {statistics.median(ts) * 1e3:7.1f} ms "
              f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f}, n={len(ts)})")
    g, p = statistics.median(sides["grouped"]), statistics.median(sides["padded"])
    a = statistics.median(sides["short chats alone"])
    print(f"  padded / grouped: {p / g:.2f}x; grouped / short chats alone: {g / a:.2f}x")


if __name__ == "__main__":
    main()
